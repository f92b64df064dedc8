"""The placement of replicas on nodes: the pure placement, the cluster view it reads, GPU
picking, fabrics, preemption."""
