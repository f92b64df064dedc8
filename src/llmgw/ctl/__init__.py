"""The operator's client: where to reach the server, requests, and rendering."""
