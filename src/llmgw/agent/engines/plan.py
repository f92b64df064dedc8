"""What a launch plan is: the processes to start for one engine spec on this node.

Pure data. The supervisor merges each process's `env` over its own environment, starts
the processes in order in one new session, and, when `wait_for_ray_nodes` is set, waits
between the earlier processes and the last one until the Ray cluster at `ray_address`
counts that many alive nodes (`ray_status_argv` prints the status; `count_ray_nodes`
in llmgw.agent.engines.ray reads it). The last process is the engine's main process.
"""

from __future__ import annotations

from attrs import field, frozen


@frozen
class ProcessPlan:
    name: str  # "engine", "ray-head", "ray-worker": for logs
    argv: tuple[str, ...]
    # Only the variables llmgw sets or overrides; the supervisor merges them over its own
    # environment. The deployment's own env is already applied (it wins).
    env: dict[str, str] = field(factory=dict)
    cwd: str = ""


@frozen
class Preflight:
    """The probe the launcher runs before the earlier processes and the engine
    (llmgw.agent.engines.preflight): bounded by `timeout` seconds, its result written to
    `result_path`; `required`: the engine starts only if it passed (else best effort)."""

    process: ProcessPlan
    timeout: float = 60.0
    required: bool = True
    # Below this bus bandwidth (GB/s, at the largest size) it fails; 0: correctness and
    # time only (CPU, or no floor asked for).
    min_busbw_gbps: float = 0.0
    result_path: str = ""
    # Without min_busbw_gbps, the floor where the probe ran NCCL on GPUs: a fraction of
    # the fabric's rate over the HCAs this member's GPUs ride (GB/s); 0: none known.
    nccl_floor_gbps: float = 0.0


@frozen
class LaunchPlan:
    processes: tuple[ProcessPlan, ...]  # started in order; the last is the main process
    # Whether GET /health on the spec's port tells the engine's health. False for gang
    # members other than rank 0 (headless vLLM, Ray workers, SGLang's dummy health
    # server): those are watched for liveness only.
    health_checked: bool = True
    # Ray head: wait until the cluster counts this many alive nodes before the last process.
    wait_for_ray_nodes: int = 0
    ray_address: str = ""  # "head_addr:gcs_port" of this replica's own Ray cluster
    ray_status_argv: tuple[str, ...] = ()  # e.g. (ray_bin, "status", "--address", addr)
    # Deployment env keys that replaced a value llmgw would have set (the supervisor
    # logs them, once per start).
    env_overrides: tuple[str, ...] = ()
    # (GPU UUID, NVML index) per placed GPU, in CUDA_VISIBLE_DEVICES order: for the log
    # and the engine's record (the environment carries the UUIDs as LLMGW_GPU_UUIDS too).
    gpus: tuple[tuple[str, int], ...] = ()
    # Gang members: the collective pre-flight to pass before anything starts; None: none.
    preflight: Preflight | None = None
    # How the main process gets the API key the agent made for it (engines/keys.py), the
    # value never being in the plan: the variable the spawn sets to it, and the file it
    # writes it to (mode 0600) before the start. "": not that way.
    api_key_env: str = ""
    api_key_file: str = ""

    @property
    def main(self) -> ProcessPlan:
        return self.processes[-1]
