"""The vLLM back end: a `Generator` (flywheel.lm.engine) answered by a vLLM server over HTTP, for serving, the
trainer's own samples and the offline gate's completions (`open_engine`).

vLLM brings what the in-process Hugging Face back end lacks: continuous batching, paged attention and
LoRA adapters loaded at runtime on one base model. Its pins (transformers, fastapi, torch) conflict with
the project's, so it never runs in serving's process: it runs as its own server, either one this module
starts per model version from `.venv-vllm` (scripts/install_vllm.sh; the *managed* mode) or an operator's
own server named by `vllm_url`. Routing, signing, logging and the registry see a `Generator` either way.

How the contract is kept (flywheel.lm.engine):
- Serving tokenises the prompt itself (the same rules as `flywheel.lm.Policy`) and sends the token ids, so
  `prompt_token_ids` and the context accounting are the HF back end's exactly.
- One HTTP request per `GenerationRequest`, all sent at once: vLLM batches them itself, and each carries its
  own `seed`, so a request's draws do not depend on what shares the batch. vLLM's seeded sampling is its
  own (another RNG, other kernels): the same seed gives the same completion within vLLM, not the
  completion the HF back end gives for that seed.
- The server runs with `--logprobs-mode raw_logprobs`: the log-prob vLLM returns for a sampled token is
  from the model's raw logits, before temperature or any other processing, i.e. at temperature 1, the
  number the trainer's importance ratio divides by. It comes from vLLM's kernels, not the trainer's
  `token_logprobs`, so it differs in the last bits: `LOGPROB_ATOL` is the tolerance this back end declares
  and tests/test_generator_conformance.py holds it to.
- A completion ends at end-of-text, `max_tokens`, the token containing a newline (`"\\n"` is sent as a stop
  string) or the token completing a `stop` string. vLLM keeps that token in its token ids; the text shown
  and the finish reason are worked out here from the ids, by the HF back end's rules.
- `n` and streaming are serving's (serving.request makes one seeded request per choice; serving.app streams
  a logged generation), so they behave as on the HF back end.

A version is a served model (full weights: a managed server per version, or a model name the operator's
server already serves) or a LoRA adapter (a peft directory, loaded with vLLM's runtime LoRA API onto the
server of its base). `VLLMBackend.load` returns a version's `Generator` only once vLLM answers to that
version's name, and every request names it, so no version is ever answered by another's weights.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import httpx

from flywheel.lm import CheckpointError
from flywheel.lm.adapter_info import ADAPTER_INFO, adapter_base_dir, read_adapter_info
from flywheel.lm.policy import FinishReason, Generation, GenerationRequest

log = logging.getLogger(__name__)

LOGPROB_ATOL = 1e-3
"""Largest |vLLM - trainer| behaviour log-prob difference the conformance suite allows this back end (fp32 on
CPU measured well under it: bench/results/serving_backends.md). The trainer's mismatch report shows the
measured difference each cycle."""

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
_FALLBACK_CONTEXT = 2048
_ADAPTER_CONFIG = "adapter_config.json"


class EngineError(RuntimeError):
    """The vLLM server refused or failed a request, or could not be started."""


def is_adapter(path: str | Path) -> bool:
    """A peft LoRA adapter directory (served on its base model), not a full checkpoint."""
    return (Path(path) / _ADAPTER_CONFIG).is_file()


def adapter_base(adapter: str | Path) -> tuple[str, Path | None]:
    """The name of an adapter's base model and its local directory (None when there is none here): a registry
    adapter's base version, fetched beside it (flywheel.lm.adapter_info), else peft's `base_model_name_or_path`."""
    if (Path(adapter) / ADAPTER_INFO).is_file():
        return read_adapter_info(adapter).base_version, adapter_base_dir(adapter)
    base = str(json.loads((Path(adapter) / _ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or "")
    return base, (Path(base) if base and (Path(base) / "config.json").is_file() else None)


def vllm_python(configured: str = "") -> Path:
    """The interpreter that runs vLLM: `configured`, else the repo's `.venv-vllm`."""
    return Path(configured) if configured else DEFAULT_PYTHON


def vllm_unavailable(configured: str = "") -> str | None:
    """Why a managed vLLM server cannot start here (None: it can): no interpreter, or no vllm installed in it.
    Whether it imports is the server's start to find (importing vLLM takes seconds to tens of seconds; a start
    that fails raises with its log)."""
    python = vllm_python(configured)
    if not python.is_file():
        return f"{python} does not exist: run scripts/install_vllm.sh"
    installed = "import importlib.util, sys; sys.exit(not importlib.util.find_spec('vllm'))"
    probe = subprocess.run([str(python), "-c", installed], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        return f"vllm is not installed in {python}: run scripts/install_vllm.sh"
    return None


class _Tokens:
    """The prompt and completion rules of `flywheel.lm.Policy`, from the checkpoint's tokenizer and config
    alone (no weights in serving's process)."""

    def __init__(self, checkpoint: str | Path) -> None:
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        from flywheel.lm.bootstrap import quiet_transformers

        path = Path(checkpoint)
        try:
            with quiet_transformers():
                self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
                config = AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{path} has no loadable tokenizer and config: {exc}") from exc
        n = getattr(config, "max_position_embeddings", None)
        self.context = int(n) if n else _FALLBACK_CONTEXT
        ids: list[int] = []
        if self.tokenizer.eos_token_id is not None:
            ids.append(int(self.tokenizer.eos_token_id))
        config_eos: Any = None
        if (path / "generation_config.json").is_file():
            with quiet_transformers():
                config_eos = GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id
        for extra in config_eos if isinstance(config_eos, list) else [config_eos]:
            if extra is not None and int(extra) not in ids:
                ids.append(int(extra))
        if not ids:
            raise CheckpointError("the tokenizer has no EOS token; set eos_token in tokenizer_config.json.")
        self.stop_ids = ids
        self._newline: dict[int, bool] = {}

    def count(self, prompt: str) -> int:
        return max(1, len(self.tokenizer(prompt)["input_ids"]))

    def texts(self, token_ids: Sequence[int]) -> list[str]:
        return [cast(str, self.tokenizer.decode([t])) for t in token_ids]

    def text(self, token_ids: Sequence[int]) -> str:
        return cast(str, self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def encode(self, prompt: str, max_tokens: int) -> list[int]:
        """As `Policy.encode_prompt`: cut from the left (keeping a leading BOS); an empty prompt is BOS or EOS."""
        if max_tokens >= self.context:
            raise ValueError(f"max_tokens={max_tokens} leaves no room for a prompt in a {self.context}-token context.")
        ids = list(self.tokenizer(prompt)["input_ids"])
        bos = self.tokenizer.bos_token_id
        if not ids:
            ids = [int(bos if bos is not None else self.stop_ids[0])]
        limit = self.context - max_tokens
        if len(ids) > limit:
            ids = [ids[0], *ids[len(ids) - limit + 1 :]] if bos is not None and ids[0] == bos else ids[-limit:]
        return ids

    def ends_line(self, token_id: int) -> bool:
        cached = self._newline.get(token_id)
        if cached is None:
            cached = self._newline[token_id] = "\n" in self.tokenizer.decode([token_id])
        return cached

    def finish(self, ids: Sequence[int], stop: Sequence[str]) -> tuple[str, FinishReason]:
        """The text shown and the finish reason of a completion of these ids, by `Policy`'s rules."""
        text = self.text(ids)
        cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
        last = ids[-1]
        if last in self.stop_ids:
            return (text[: min(cuts)] if cuts else text), ("declined" if len(ids) == 1 else "stop")
        if cuts:
            return text[: min(cuts)], "stop"
        return text, ("stop" if self.ends_line(last) else "length")


class VLLMGenerator:
    """One model version on a vLLM server: `model` is the name the server answers to (a served model or a
    loaded LoRA adapter). Thread-safe; `generate_batch` sends its requests concurrently."""

    def __init__(self, url: str, model: str, checkpoint: str | Path, *, timeout_s: float = 300.0,
                 max_concurrency: int = 64) -> None:  # fmt: skip
        self.url = url.rstrip("/")
        self.model = model
        self._tokens = _Tokens(checkpoint)
        self._client = httpx.Client(base_url=self.url, timeout=timeout_s,
                                    limits=httpx.Limits(max_connections=max_concurrency))
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix=f"vllm-{model}")

    @property
    def context(self) -> int:
        return self._tokens.context

    def count_prompt_tokens(self, prompt: str) -> int:
        return self._tokens.count(prompt)

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        return self._tokens.texts(token_ids)

    def generate_batch(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        for request in requests:
            request.check()
        if not requests:
            return []
        prompts = [self._tokens.encode(r.prompt, r.max_tokens) for r in requests]
        return list(self._pool.map(self._one, requests, prompts))

    def sample_token_ids(
        self, prompts: Sequence[Sequence[int]], max_tokens: int, seeds: Sequence[int], temperature: float = 1.0
    ) -> list[list[int]]:
        """As `Policy.sample_token_ids`: the chosen ids of one seeded completion of each tokenised prompt."""
        return [g.completion_token_ids for g in self.generate_from_ids(prompts, max_tokens, seeds, temperature)]

    def generate_from_ids(
        self, prompts: Sequence[Sequence[int]], max_tokens: int, seeds: Sequence[int], temperature: float = 1.0
    ) -> list[Generation]:
        """`sample_token_ids` with the rest of each `Generation`: vLLM's behaviour log-probs of those tokens."""
        requests = [GenerationRequest("", max_tokens, temperature, seed) for seed in seeds]
        if len(requests) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts and {len(seeds)} seeds")
        return list(self._pool.map(self._one, requests, [list(p) for p in prompts]))

    def _one(self, request: GenerationRequest, prompt_ids: list[int]) -> Generation:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt_ids,
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "top_p": 1.0,
            "top_k": 0,  # 0: off
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "stop": [*request.stop, "\n"],
            "stop_token_ids": self._tokens.stop_ids,  # the checkpoint's extra end-of-text ids (an end of turn)
            "logprobs": request.top_logprobs,  # 0: the sampled token's alone
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": True,
        }
        if request.seed is not None:
            body["seed"] = request.seed
        answer = self._post("/v1/completions", body)
        choice = answer["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        logprobs = choice["logprobs"]
        values = [float(v) for v in logprobs["token_logprobs"]]
        if len(values) != len(ids) or not ids:
            raise EngineError(f"vLLM returned {len(ids)} tokens and {len(values)} log-probs for model {self.model}")
        top = None
        if request.top_logprobs:
            top = []
            for entry in logprobs["top_logprobs"]:
                ranked = sorted(((_token_id(k), float(v)) for k, v in entry.items()), key=lambda kv: -kv[1])
                top.append(ranked[: request.top_logprobs])
        completion, finish = self._tokens.finish(ids, request.stop)
        return Generation(prompt_token_ids=prompt_ids, completion_token_ids=ids, completion=completion,
                          logprobs=values, finish_reason=finish, top_logprobs=top)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = self._client.post(path, json=body)
        except httpx.HTTPError as exc:
            raise EngineError(f"vLLM at {self.url} did not answer: {exc}") from exc
        if response.status_code != 200:
            raise EngineError(f"vLLM at {self.url} answered {response.status_code}: {response.text[:500]}")
        return cast(dict[str, Any], response.json())

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._client.close()


def _token_id(key: str) -> int:
    """vLLM names tokens `token_id:N` when asked to (`return_tokens_as_token_ids`)."""
    return int(key.rsplit(":", 1)[1])


def served_names(url: str) -> set[str]:
    """The model names (versions, adapters included) the vLLM server at `url` answers to."""
    try:
        data = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=30).json()["data"]
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        raise EngineError(f"vLLM at {url} did not list its models: {exc}") from exc
    return {m["id"] for m in data}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerOptions:
    """How a managed vLLM server is started. `kv_cache_gb`: on CPU vLLM sizes its KV cache from RAM
    (VLLM_CPU_KVCACHE_SPACE); `max_loras`/`max_lora_rank`: adapters one server holds at once; `lora=False` starts
    one without runtime LoRA (a server for full weights alone; it starts faster); `single_process`: the engine and
    its worker in the API server's process (one import of vLLM instead of three: 46 s against 98-149 s for the
    test model on two loaded cores), for a server that does one piece of work and stops, not one serving users."""

    python: str = ""
    kv_cache_gb: int = 1
    dtype: str = "float32"
    max_loras: int = 4
    max_lora_rank: int = 16
    lora: bool = True
    single_process: bool = False
    start_timeout_s: float = 600.0
    extra_args: tuple[str, ...] = ()


class VLLMServer:
    """A vLLM OpenAI-compatible server this process starts (the managed mode), serving one checkpoint under
    the name `served_name`, with runtime LoRA loading on. Its output goes to a temporary log file, named in the
    error and kept when it fails, removed when it is stopped after a clean run."""

    def __init__(self, checkpoint: str | Path, served_name: str, options: ServerOptions | None = None) -> None:
        self.checkpoint = str(checkpoint)
        self.served_name = served_name
        self.options = options or ServerOptions()
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._keep_log = False

    def command(self) -> list[str]:
        o = self.options
        return [
            str(vllm_python(o.python)), "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.checkpoint, "--served-model-name", self.served_name,
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", o.dtype,
            "--enforce-eager",  # no graph compile: minutes saved at start, on CPU nothing lost
            "--logprobs-mode", "raw_logprobs", "--max-logprobs", "21",
            *(("--enable-lora", "--max-loras", str(o.max_loras), "--max-lora-rank", str(o.max_lora_rank))
              if o.lora else ()),
            "--generation-config", "vllm",  # the request's sampling settings, not the checkpoint's defaults
            "--disable-log-stats", "--uvicorn-log-level", "warning",
            *(("--distributed-executor-backend", "uni") if o.single_process else ()),
            *o.extra_args,
        ]  # fmt: skip

    def start(self) -> VLLMServer:
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(self.options.kv_cache_gb),
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
        }
        if self.options.single_process:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115  # open while the server runs; closed in stop()
            prefix=f"vllm-{self.served_name}-", suffix=".log", delete=False
        )
        log.info("starting vLLM for %s on port %d (log %s)", self.served_name, self.port, self._log.name)
        self._process = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + self.options.start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise EngineError(f"vLLM for {self.served_name} exited ({self._process.returncode}): {self._tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self._warmed()
            time.sleep(0.5)
        self.stop()
        raise EngineError(f"vLLM for {self.served_name} did not start in {self.options.start_timeout_s:.0f} s")

    def _warmed(self) -> VLLMServer:
        """One token sampled before the server is handed out: an engine that starts but cannot run the model
        (on CPU, a head size its attention lacks) is refused here, with its log, not on a user's request."""
        answer = httpx.post(f"{self.url}/v1/completions", timeout=self.options.start_timeout_s,
                            json={"model": self.served_name, "prompt": [0], "max_tokens": 1})  # fmt: skip
        if answer.status_code != 200:
            tail = self._tail()
            self.stop()
            raise EngineError(f"vLLM for {self.served_name} started but could not sample: {tail}")
        return self

    def _tail(self) -> str:
        if self._log is None:
            return ""
        self._keep_log = True  # named in an error: left for whoever reads it
        if not self._log.closed:
            self._log.flush()
        lines = Path(self._log.name).read_text(errors="replace").splitlines()
        return "\n".join(lines[-15:]) + f"\n(full log: {self._log.name})"

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None
        if self._log is not None:
            self._log.close()
            if not self._keep_log:  # a clean run's log goes with it
                Path(self._log.name).unlink(missing_ok=True)


class VLLMBackend:
    """The serving pool's loader on vLLM: the `Generator` of a version, loaded before it is routed to.

    `url` set: the operator's server. A full-weights version must be one of the models it serves (by name);
    an adapter is loaded onto it by name with `POST /v1/load_lora_adapter` (its path must be readable by
    that server). `url` empty (managed): a full-weights version gets a server of its own; an adapter is
    loaded onto the managed server of its base (a registry adapter's base version, fetched beside it; else peft's
    `base_model_name_or_path`), started for that base when none runs. `release` unloads or stops
    what a version no longer routed to holds."""

    def __init__(self, url: str = "", options: ServerOptions | None = None, *, release_grace_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.options = options or ServerOptions()
        self._servers: dict[str, VLLMServer] = {}  # managed: version -> its server
        self._adapters: dict[str, str] = {}  # version -> url of the server holding it
        self._generators: dict[str, VLLMGenerator] = {}
        self._lock = threading.Lock()
        self.release_grace_s = release_grace_s
        self._releasing: dict[str, threading.Timer] = {}

    def load(self, version: str, checkpoint: str | Path) -> VLLMGenerator:
        """The version's generator once vLLM answers to its name; CheckpointError (the pool's refusal, retried
        after a backoff) when vLLM could not load it."""
        with self._lock:
            pending = self._releasing.pop(version, None)
            if pending is not None:
                pending.cancel()
            if version in self._generators:
                return self._generators[version]
            try:
                adapter = is_adapter(checkpoint)
                url = self._load_adapter(version, checkpoint) if adapter else self._serve(version, checkpoint)
            except EngineError as exc:
                raise CheckpointError(f"vLLM could not load version {version}: {exc}") from exc
            served = served_names(url)
            if version not in served:  # never routed to a name vLLM would not answer with this version's weights
                raise CheckpointError(f"vLLM at {url} does not serve {version} (it serves {sorted(served)})")
            # an adapter directory holds no tokenizer: its base's is the one it was trained with
            tokens_from = adapter_base(checkpoint)[1] if adapter else checkpoint
            if tokens_from is None:
                raise CheckpointError(f"no local copy of the base of adapter {version} to read its tokenizer from")
            generator = VLLMGenerator(url, version, tokens_from)
            self._generators[version] = generator
            return generator

    def _serve(self, version: str, checkpoint: str | Path) -> str:
        if self.url:
            return self.url
        server = VLLMServer(checkpoint, version, self.options).start()
        self._servers[version] = server
        return server.url

    def _load_adapter(self, version: str, checkpoint: str | Path) -> str:
        base, base_dir = adapter_base(checkpoint)
        url = self.url or self._base_server(base, base_dir)
        response = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": version, "lora_path": str(checkpoint)},
                              timeout=300)  # fmt: skip
        if response.status_code != 200 and "already been loaded" not in response.text:
            raise CheckpointError(f"vLLM refused adapter {version}: {response.text[:500]}")
        self._adapters[version] = url
        return url

    def _base_server(self, base: str, base_dir: Path | None) -> str:
        for name, server in self._servers.items():
            same_dir = base_dir is not None and base_dir.resolve() == Path(server.checkpoint).resolve()
            if base == name or same_dir:
                return server.url
        if base_dir is None:
            raise CheckpointError(f"the adapter's base {base!r} is neither a served version nor a local checkpoint")
        server = VLLMServer(base_dir, base, self.options).start()
        self._servers[base] = server
        return server.url

    def release(self, version: str) -> None:
        """Free what `version` holds after `release_grace_s` (requests routed before the swap finish on it),
        unless it is loaded again meanwhile."""
        timer = threading.Timer(self.release_grace_s, self.release_now, [version])
        timer.daemon = True
        with self._lock:
            self._releasing[version] = timer
        timer.start()

    def release_now(self, version: str) -> None:
        """Free what `version` holds (its adapter, or its managed server once no adapter needs it)."""
        with self._lock:
            self._releasing.pop(version, None)
            generator = self._generators.pop(version, None)
            if generator is not None:
                generator.close()
            url = self._adapters.pop(version, None)
            if url is not None:
                with contextlib.suppress(httpx.HTTPError):
                    httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": version}, timeout=60)
            server = self._servers.get(version)
            if server is not None and server.url not in self._adapters.values():
                self._servers.pop(version).stop()

    def close(self) -> None:
        for timer in list(self._releasing.values()):
            timer.cancel()
        for version in list(self._generators):
            self.release_now(version)
        for server in self._servers.values():
            server.stop()
        self._servers.clear()


def main() -> None:  # pragma: no cover - a manual check: `python -m flywheel.lm.vllm CHECKPOINT`
    """Start a managed server on a checkpoint and sample one completion."""
    logging.basicConfig(level=logging.INFO)
    server = VLLMServer(sys.argv[1], "manual").start()
    try:
        print(VLLMGenerator(server.url, "manual", sys.argv[1]).generate_batch([GenerationRequest("def ", seed=0)]))
    finally:
        server.stop()


if __name__ == "__main__":
    main()


__all__ = ["LOGPROB_ATOL", "EngineError", "ServerOptions", "VLLMBackend", "VLLMGenerator", "VLLMServer",
           "adapter_base", "is_adapter", "served_names", "vllm_unavailable"]
