"""KV-cache-aware routing, measured on two real vLLM engines (the CPU build, the tiny Llama of
the real-engine tier with a KV cache smaller than the working set): the same seeded
workloads through each router arm, scored by the engines' own prefix-cache hit rate and by
time to first token.

    .venv/bin/python bench/kv_routing.py                     # every arm that can run here
    .venv/bin/python bench/kv_routing.py --arms llmgw:least_outstanding,llmgw:kv_aware --json kv.json
    .venv/bin/python bench/kv_routing.py --arms llmgw:kv_aware@0.02,llmgw:kv_aware@0.05   # kv_weight

Needs the real-engine tier's vLLM venv (tests/real_engine/install_vllm.sh, .ci-vllm-venv)
and, for the peers' arms, a venv with `vllm-router` and `sglang-router` from PyPI
(`python3 -m venv .bench-peers-venv && .bench-peers-venv/bin/pip install vllm-router
sglang-router`); arms whose router is missing are listed as skipped, with why.

Workloads (seeded; words drawn from a fixed list, so the token counts are the tokenizer's):
- (a) `docs`: 16 long documents x 12 questions each, shuffled, 4 clients at once:
  completions, prompt = document + question.
- (b) `chat`: 12 users sharing a system prompt, each with a private context, 5 turns with
  the whole history (the engine's own answers included), the 12 users at once:
  chat completions.
Both ask `max_tokens` 8 with `ignore_eos` (every answer the same length) and stream.

Arms: llmgw's router (`least_outstanding`, `prefix_affinity`, `kv_aware`) in front of two
engines its own agent runs (kv_events on); the peers in front of two engines this script
starts with the same arguments (their events bound for vllm-router's `kv_aware`):
vllm-router `round_robin`, `cache_aware`, `kv_aware`, sglang-router `cache_aware`.
Between arms both engines' prefix caches are reset (POST /reset_prefix_cache: vLLM's dev
endpoint, VLLM_SERVER_DEV_MODE=1), and the score is the delta of the engines'
`vllm:prefix_cache_hits_total` over `vllm:prefix_cache_queries_total` (tokens, both
engines summed).

A figure, not a test: printed as JSON, every arm's figures in bench/README.md.
"""

from __future__ import annotations

import argparse
import functools
import http.client
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "real_engine")]

BLOCK = 32  # tokens a KV block holds (the CPU build wants a multiple of 32)
MAX_LEN = 4096
GPU_BLOCKS = 400  # per engine: 12,800 tokens, under the working set of either workload (about 21,000)
ANSWER_TOKENS = 8
ARMS = ("llmgw:least_outstanding", "llmgw:prefix_affinity", "llmgw:kv_aware",
        "vllm-router:round_robin", "vllm-router:cache_aware", "vllm-router:kv_aware",
        "sglang-router:cache_aware")
# The CPU build binds each engine's OpenMP thread to a core it picks itself ("auto": core 0
# for both engines here, each reserving core 1): two engines busy at once then share one
# core, spinning on each other, and a request stalls for seconds (seen: 1-7 s, while the
# same requests to one engine at a time take 0.1 s). Unbound, passive threads: the
# kernel shares the two cores between them.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1",
              "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_WAIT_POLICY": "PASSIVE"}
ENGINE_ARGS = ["--max-model-len", str(MAX_LEN), "--enforce-eager", "--dtype", "float32",
               "--block-size", str(BLOCK), "--num-gpu-blocks-override", str(GPU_BLOCKS)]
READY_TIMEOUT = 600.0


# -- workloads ---------------------------------------------------------------------------

def _text(rng: random.Random, words: int) -> str:
    return " ".join(f"{rng.choice(_WORDS)}{rng.randrange(100)}" for _ in range(words))


_WORDS = ("alpha", "river", "stone", "paper", "cloud", "lamp", "orbit", "field", "glass",
          "mirror", "signal", "copper", "garden", "engine", "window", "harbor")


def docs_workload(seed: int) -> list[list[dict[str, Any]]]:
    """16 documents x 12 questions, shuffled: one request per session."""
    rng = random.Random(seed)
    docs = [f"Document {d}.\n" + _text(rng, 250) for d in range(16)]
    reqs = [{"prompt": f"{doc}\nQuestion {q}: {_text(rng, 8)}?\nAnswer:"}
            for doc in docs for q in range(12)]
    rng.shuffle(reqs)
    return [[r] for r in reqs]


def chat_workload(seed: int) -> list[list[dict[str, Any]]]:
    """12 users, a shared system prompt, a private context each, 5 turns: one session per
    user (its turns in order, each carrying the history). All the users' histories at
    their end are about 30,000 tokens: more than one engine holds, less than two."""
    rng = random.Random(seed + 1)
    system = "You are a helpful assistant. " + _text(rng, 140)
    users = []
    for u in range(12):
        context = f"User {u} context: " + _text(rng, 220)
        turns = [f"Turn {t}: {_text(rng, 10)}?" for t in range(5)]
        users.append([{"system": system, "context": context, "turn": t, "question": q}
                      for t, q in enumerate(turns)])
    return users


# -- one request -------------------------------------------------------------------------

def stream(base: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
           ) -> tuple[float, str]:
    """POST a streamed request; (seconds to the first token, the text)."""
    host, _, port = base.removeprefix("http://").rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    t0 = time.monotonic()
    try:
        conn.request("POST", path, json.dumps(body).encode(),
                     {"content-type": "application/json", **(headers or {})})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"{base}{path}: {r.status} {r.read()[:300]!r}")
        ttft, text = -1.0, []
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                piece = c.get("text") or (c.get("delta") or {}).get("content") or ""
                if piece and ttft < 0:
                    ttft = time.monotonic() - t0
                text.append(piece)
        return ttft, "".join(text)
    finally:
        conn.close()


def run_workload(base: str, kind: str, sessions: list[list[dict[str, Any]]], clients: int
                 ) -> list[float]:
    """Every session through `base`; the TTFT of each request."""
    ttfts: list[float] = []
    lock = threading.Lock()

    def one(session: list[dict[str, Any]]) -> None:
        history: list[dict[str, str]] = []
        for req in session:
            if kind == "docs":
                body: dict[str, Any] = {"model": "tiny", "prompt": req["prompt"]}
                path = "/v1/completions"
            else:
                if not history:
                    history = [{"role": "system", "content": req["system"]},
                               {"role": "user", "content": req["context"]}]
                    history.append({"role": "assistant", "content": "Noted."})
                history.append({"role": "user", "content": req["question"]})
                body = {"model": "tiny", "messages": list(history)}
                path = "/v1/chat/completions"
            body.update(max_tokens=ANSWER_TOKENS, ignore_eos=True, temperature=0, stream=True)
            ttft, text = stream(base, path, body)
            if kind == "chat":
                history.append({"role": "assistant", "content": text})
            with lock:
                ttfts.append(ttft)

    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(one, s) for s in sessions]:
            f.result()
    return ttfts


# -- engines -----------------------------------------------------------------------------

def scrape(url: str, key: str) -> tuple[float, float]:
    """(prefix-cache hits, queries) of one engine, in tokens."""
    host, _, port = url.removeprefix("http://").rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", "/metrics", headers={"authorization": f"Bearer {key}"} if key else {})
        text = conn.getresponse().read().decode()
    finally:
        conn.close()

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    return total("vllm:prefix_cache_hits_total"), total("vllm:prefix_cache_queries_total")


def reset_cache(url: str, key: str) -> None:
    host, _, port = url.removeprefix("http://").rpartition(":")
    for _ in range(50):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request("POST", "/reset_prefix_cache",
                         headers={"authorization": f"Bearer {key}"} if key else {})
            r = conn.getresponse()
            body = r.read()
        finally:
            conn.close()
        if r.status == 200 and json.loads(body or b"{}").get("success", True):
            return
        time.sleep(0.2)  # blocks still held by a request finishing
    raise RuntimeError(f"{url}: reset_prefix_cache kept failing ({r.status} {body[:200]!r})")


def _get(url: str) -> int:
    host, _, port = url.removeprefix("http://").rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except OSError:
        return 0
    finally:
        conn.close()


def wait(cond: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.5)


class Procs:
    """Processes this script started, killed by pid (their whole session) at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None
              ) -> subprocess.Popen[bytes]:
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 - the child holds it
        p = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT,
                             env={**os.environ, **(env or {})}, start_new_session=True,
                             cwd=self.root)
        log.close()
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen[bytes]) -> None:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        for p in reversed(self.procs):
            self.stop(p)


def free_port() -> int:
    from fakes.engines import free_port as fp
    return fp()


# -- arms --------------------------------------------------------------------------------

def score(before: list[tuple[float, float]], after: list[tuple[float, float]],
          ttfts: list[float], seconds: float) -> dict[str, Any]:
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    t = sorted(x for x in ttfts if x >= 0)

    def pct(p: float) -> float:
        return round(t[min(len(t) - 1, int(p * len(t)))] * 1000, 1) if t else -1.0

    return {"hit_rate": round(hits / queries, 4) if queries else 0.0, "hit_tokens": int(hits),
            "query_tokens": int(queries),
            # how the prompts' tokens were split between the engines (balance)
            "per_engine": [int(a[1] - b[1]) for a, b in zip(after, before, strict=True)], "ttft_p50_ms": pct(0.5), "ttft_p90_ms": pct(0.9),
            "requests": len(ttfts), "seconds": round(seconds, 1)}


def measure(base: str, engines: list[tuple[str, str]], workloads: dict[str, Any]
            ) -> dict[str, Any]:
    out = {}
    for kind, (sessions, clients) in workloads.items():
        for url, key in engines:
            reset_cache(url, key)
        time.sleep(1.0)  # the clears reach the routers that follow the events
        before = [scrape(u, k) for u, k in engines]
        t0 = time.monotonic()
        ttfts = run_workload(base, kind, sessions, clients)
        seconds = time.monotonic() - t0
        out[kind] = score(before, [scrape(u, k) for u, k in engines], ttfts, seconds)
        print(f"    {kind}: {out[kind]}", flush=True)
    return out


def warm(base: str) -> None:
    """A few short requests through a router first (its connections, its tables)."""
    for _ in range(4):
        stream(base, "/v1/completions", {"model": "tiny", "prompt": "warm up", "max_tokens": 2,
                                         "stream": True})


def warm_engines(engines: list[tuple[str, str]], seed: int) -> None:
    """Each engine straight, before any arm: prompts of the workloads' lengths, a few at
    once. The CPU build's first forward passes at a new shape are slow (seconds: its
    kernels are set up then); left to the first arm, a replica stuck on them for its
    first requests takes no more while the other serves the rest, whatever the policy."""
    rng = random.Random(seed + 100)
    bodies = [{"model": "tiny", "prompt": _text(rng, words), "max_tokens": ANSWER_TOKENS,
               "ignore_eos": True, "stream": True}
              for words in (10, 60, 250, 250, 400, 600, 800, 250)]

    def one(url: str, key: str, body: dict[str, Any]) -> None:
        stream(url, "/v1/completions", body, {"authorization": f"Bearer {key}"} if key else None)

    with ThreadPoolExecutor(8) as pool:
        for _ in range(2):
            for f in [pool.submit(one, u, k, b) for u, k in engines for b in bodies]:
                f.result()


def llmgw_arms(arms: list[str], model: Path, vllm: Path, root: Path, workloads: dict[str, Any]
               ) -> dict[str, Any]:
    from fakes.engine_keys import url_key
    from fakes.live import Cluster
    from fakes.nvidia_smi import pcie_box
    from fakes.vllm_rig import vllm_agent

    results: dict[str, Any] = {}
    c = Cluster(root / "llmgw", heartbeat="1s", lost_after="60s")
    try:
        c.start_server()
        # The test cluster's agents relay no KV events unless given a port (several agents
        # share one host there): this one does.
        c.start_agent("cpu-1", **vllm_agent(vllm, pcie_box(root / "smi")), kv_relay_port=free_port())
        c.wait_states({"cpu-1": "ready"}, timeout=60)
        c.apply("tiny", (f"name: tiny\nmodel: {model}\nengine: vllm\ngpus_per_node: 1\nreplicas: 2\n"
                         f"served_name: tiny\nkv_events: true\nstartup_timeout: {int(READY_TIMEOUT)}s\n"
                         f"args: {json.dumps(ENGINE_ARGS)}\nenv: {json.dumps(ENGINE_ENV)}\n"))
        wait(lambda: sum(r.get("state") == "ready" for r in c.replicas().values()) == 2,
             READY_TIMEOUT, "two ready vLLM replicas")
        engines = [(str(r["endpoint"]), "") for r in c.replicas().values()]
        engines = [(u, url_key(u)) for u, _ in engines]
        warm_engines(engines, 0)
        for arm in arms:
            policy, _, weight = arm.split(":", 1)[1].partition("@")
            extra = f'metrics_interval = "250ms"\n[models.tiny]\npolicy = "{policy}"\n'
            if policy == "kv_aware":
                extra += f'tokenizer = "{model}"\n'
                if weight:
                    extra += f"kv_weight = {float(weight)}\n"
            router, port = c.start_router(f"r-{policy}{weight}", extra=extra)
            base = f"http://127.0.0.1:{port}"
            try:
                wait(functools.partial(_lists, base), 60, f"router {arm} lists the model")
                warm(base)
                print(f"  {arm}", flush=True)
                results[arm] = measure(base, engines, workloads)
            except Exception as e:  # noqa: BLE001 - one arm's failure is reported, the rest run
                results[arm] = {"error": f"{type(e).__name__}: {e}"}
                print(f"  {arm}: {results[arm]['error']}", flush=True)
            finally:
                router.stop()
    finally:
        c.close()
    return results


def _healthy(url: str) -> bool:
    return _get(url) == 200


def _lists(base: str) -> bool:
    return "tiny" in (_models(base) or [])


def _answers(base: str, p: subprocess.Popen[bytes]) -> bool:
    return _models(base) is not None or p.poll() is not None


def _models(base: str) -> list[str] | None:
    """The model ids a router lists; None while it does not answer 200."""
    host, _, port = base.removeprefix("http://").rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request("GET", "/v1/models")
        r = conn.getresponse()
        body = r.read()
        return [m.get("id") for m in json.loads(body).get("data", [])] if r.status == 200 else None
    except (OSError, ValueError, AttributeError):
        return None
    finally:
        conn.close()


def peer_arms(arms: list[str], model: Path, vllm: Path, peers: Path, root: Path,
              workloads: dict[str, Any]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    runnable = []
    for arm in arms:
        exe = peers / "bin" / arm.split(":", 1)[0]
        if exe.exists():
            runnable.append(arm)
        else:
            results[arm] = {"skipped": f"{exe} not installed"}
    if not runnable:
        return results
    procs = Procs(root)
    try:
        engines: list[tuple[str, str]] = []
        events: list[tuple[str, str, str]] = []
        for i in range(2):
            port, pub, replay = free_port(), free_port(), free_port()
            cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
                   "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}",
                   "topic": "kv"}
            procs.start(f"engine-{i}", [str(vllm / "bin" / "vllm"), "serve", str(model),
                                        "--served-model-name", "tiny", "--host", "127.0.0.1",
                                        "--port", str(port), *ENGINE_ARGS,
                                        "--kv-events-config", json.dumps(cfg)], ENGINE_ENV)
            engines.append((f"http://127.0.0.1:{port}", ""))
            events.append((f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{pub}",
                           f"tcp://127.0.0.1:{replay}"))
        for url, _ in engines:
            wait(functools.partial(_healthy, url), READY_TIMEOUT, f"engine {url} ready")
        warm_engines(engines, 0)
        urls = [u for u, _ in engines]
        for arm in runnable:
            name, policy = arm.split(":", 1)
            router_port = free_port()
            router_exe = str(peers / "bin" / name)
            argv: list[str]
            if name == "vllm-router":
                argv = [router_exe, "--host", "127.0.0.1", "--port", str(router_port), "--worker-urls", *urls,
                        "--policy", policy]
                if policy == "kv_aware":
                    for worker, pub_at, replay_at in events:
                        argv += ["--kv-event-source", f"{worker}={pub_at}",
                                 "--kv-event-replay-source", f"{worker}={replay_at}"]
                    argv += ["--kv-event-block-size", str(BLOCK), "--kv-event-model", str(model)]
            else:
                argv = [router_exe, "launch", "--host", "127.0.0.1", "--port", str(router_port),
                        "--worker-urls", *urls, "--policy", policy]
            p = procs.start(f"router-{name}-{policy}", argv)
            base = f"http://127.0.0.1:{router_port}"
            try:
                # Any model list will do: sglang-router names the model its own way.
                wait(functools.partial(_answers, base, p), 120, f"{arm} answers")
                if p.poll() is not None:
                    raise RuntimeError(f"{arm} exited {p.returncode}: "
                                       + (root / f"router-{name}-{policy}.log").read_text()[-800:])
                warm(base)
                print(f"  {arm}", flush=True)
                results[arm] = measure(base, engines, workloads)
            except Exception as e:  # noqa: BLE001 - one arm's failure is reported, the rest run
                results[arm] = {"error": f"{type(e).__name__}: {e}"}
                print(f"  {arm}: {results[arm]['error']}", flush=True)
            finally:
                procs.stop(p)
    finally:
        procs.close()
    return results


def make_model(vllm: Path, out: Path) -> None:
    r = subprocess.run([str(vllm / "bin" / "python"), str(ROOT / "tests" / "real_engine" / "make_model.py"),
                        str(out)], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"make_model.py failed: {r.stdout}{r.stderr}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--workloads", default="docs,chat")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--vllm-venv", default=os.environ.get("LLMGW_VLLM_VENV", str(ROOT / ".ci-vllm-venv")))
    ap.add_argument("--peers-venv", default=str(ROOT / ".bench-peers-venv"))
    ap.add_argument("--json", default="")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    a = ap.parse_args()
    arms = [x for x in a.arms.split(",") if x]
    unknown = [x for x in arms if x.partition("@")[0] not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; choose from {', '.join(ARMS)}")
    vllm = Path(a.vllm_venv)
    if not (vllm / "bin" / "vllm").exists():
        raise SystemExit(f"no vLLM at {vllm}/bin/vllm: tests/real_engine/install_vllm.sh makes one")
    all_workloads = {"docs": (docs_workload(a.seed), 4), "chat": (chat_workload(a.seed), 12)}
    workloads = {k: all_workloads[k] for k in a.workloads.split(",")}
    root = Path(tempfile.mkdtemp(prefix="llmgw-kvbench-"))
    print(f"work folder {root}", flush=True)
    results: dict[str, Any] = {}
    try:
        model = root / "tiny"
        make_model(vllm, model)
        mine = [x for x in arms if x.startswith("llmgw:")]
        if mine:
            results.update(llmgw_arms(mine, model, vllm, root, workloads))
        theirs = [x for x in arms if not x.startswith("llmgw:")]
        if theirs:
            results.update(peer_arms(theirs, model, vllm, Path(a.peers_venv), root, workloads))
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    out = {"block_size": BLOCK, "gpu_blocks_per_engine": GPU_BLOCKS, "max_model_len": MAX_LEN,
           "answer_tokens": ANSWER_TOKENS, "seed": a.seed, "arms": results}
    print(json.dumps(out, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
