"""Elastic deployments: the autoscaler's decision (decide.py), its loop, the routers' load
board."""
