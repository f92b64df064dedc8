"""This node's GPUs as the agent watches them around its engines: who claims them right
before a spawn, their memory, whether they came back after an engine stopped, their use for
/metrics, and NVML's Xid events."""
