"""The compiled layers kept between runs: torch's compile caches in a directory that survives reboots.

torch.compile's layers cost ~90 s at the first step of an 8B run on the H200 (issue 45, 2026-11-28).
Inductor keeps what it compiled in two on-disk caches that a later process reads instead of compiling
again: the FX-graph cache (inductor's generated code; Triton's kernels bundled with it) and the
AOTAutograd cache (the forward/backward split), both on by default in torch 2.11-2.13
(torch._inductor.config.fx_graph_cache, torch._functorch.config.enable_autograd_cache); this module
switches them on in case an environment turned them off. Their default home is
/tmp/torchinductor_$USER, emptied at each reboot, and Triton's kernels go below it
(cache_dir_utils.triton_cache_dir: TORCHINDUCTOR_CACHE_DIR/triton unless TRITON_CACHE_DIR is set).
So a run points TORCHINDUCTOR_CACHE_DIR at `runtime.compile_cache_dir` (default
$XDG_CACHE_HOME/slidetune/compile, else ~/.cache/slidetune/compile) before its first compile, unless
the user set TORCHINDUCTOR_CACHE_DIR to another directory than torch's default (theirs is kept; a
set TRITON_CACHE_DIR is Triton's to read).
"off" leaves torch's defaults alone.

torch's "mega-cache" (torch.compiler.save_cache_artifacts / load_cache_artifacts) is not used: it
packs these same FX-graph, AOTAutograd and Triton entries into one blob to carry them to another
machine; on the machine that compiled them the directory already holds them, and Dynamo's tracing,
which neither cache skips, is paid either way.

Which run it was comes from dynamo's counters (torch._dynamo.utils.counters: "inductor"'s
fxgraph_cache_hit / _miss, "aot_autograd"'s autograd_cache_hit / _miss) and its compile-time
metrics, read as differences from a snapshot taken before the engine is built.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"
# what torch records the compile time under (torch._dynamo.utils.compilation_time_metrics): a frame's
# compile (Dynamo, AOTAutograd's forward, inductor) and the backward graph's, compiled at the first backward
_COMPILE_METRICS = ("_compile.compile_inner", "backward._backward_impl")
# the values this process set TORCHINDUCTOR_CACHE_DIR to: a later run in the same process (tests, the
# benchmarks) may point it elsewhere, as they are not the user's
_set_here: set[str] = set()


def default_compile_cache_dir() -> Path:
    """$XDG_CACHE_HOME/slidetune/compile, else ~/.cache/slidetune/compile."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "slidetune" / "compile"


@dataclass(frozen=True)
class CompileCache:
    """Where this run's compiled layers are read from and written to."""
    directory: Path | None      # None: torch's own default (/tmp/torchinductor_$USER), "off"
    source: str                 # how it was chosen, for the run's line

    @property
    def persistent(self) -> bool:
        return self.directory is not None


def _torch_default_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    return default_cache_dir()


def use_compile_cache(setting: str | None) -> CompileCache:
    """Point inductor's caches at `setting` (runtime.compile_cache_dir: None -> the default above,
    "off" -> torch's defaults untouched) unless the user set TORCHINDUCTOR_CACHE_DIR; switch the
    FX-graph and AOTAutograd caches on. Call before the first torch.compile'd call."""
    if setting is not None and setting.strip().lower() == "off":
        return CompileCache(None, "off: torch's default cache directory")
    user_dir = os.environ.get(INDUCTOR_ENV)
    # torch writes its default into the variable when torch._dynamo is imported (torch 2.13:
    # _dynamo/package.py calls cache_dir()): that value is torch's, not the user's
    if user_dir and user_dir not in _set_here and os.path.abspath(user_dir) != os.path.abspath(_torch_default_dir()):
        directory, source = Path(user_dir), f"{INDUCTOR_ENV} set by the user"
    else:
        directory = Path(setting).expanduser() if setting else default_compile_cache_dir()
        source = "--compile-cache-dir" if setting else "the default"
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"runtime.compile_cache_dir: cannot create {directory} ({e}); give a writable "
                             f"directory with --compile-cache-dir, or off") from e
        os.environ[INDUCTOR_ENV] = str(directory.resolve())
        _set_here.add(os.environ[INDUCTOR_ENV])
    _switch_caches_on()
    return CompileCache(directory, source)


def _switch_caches_on() -> None:
    """On, unless the user turned one off through torch's own variable (kept, as their directory is)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    if os.environ.get("TORCHINDUCTOR_FX_GRAPH_CACHE") != "0":
        inductor_config.fx_graph_cache = True
    if os.environ.get("TORCHINDUCTOR_AUTOGRAD_CACHE") != "0":
        functorch_config.enable_autograd_cache = True


def describe_cache(cache: CompileCache) -> str:
    """Where the compiled layers go, said before the run starts."""
    if not cache.persistent:
        return f"compile cache: {_torch_default_dir()} (--compile-cache-dir off: torch's default, emptied at reboot)"
    return f"compile cache: {cache.directory} ({cache.source}; --compile-cache-dir off leaves torch's default)"


@dataclass(frozen=True)
class CompileCounters:
    """Dynamo's cache counters and compile seconds at one moment (process-wide totals)."""
    fx_hits: int = 0
    fx_misses: int = 0
    fx_bypasses: int = 0        # graphs inductor would not cache (fxgraph_cache_bypass: e.g. an unpicklable input)
    autograd_hits: int = 0
    autograd_misses: int = 0
    compile_s: float = 0.0
    # Dynamo frames compiled: one per compiled function and set of guards; a recompile (a guard that
    # failed: grad mode, a mask's form, a shape) adds one. 2 for HF's layer (the no-grad forward and the recompute)
    frames: int = 0

    @staticmethod
    def now() -> "CompileCounters":
        from torch._dynamo.utils import compilation_time_metrics, counters
        inductor, aot = counters["inductor"], counters["aot_autograd"]
        seconds = sum(sum(compilation_time_metrics.get(name, [])) for name in _COMPILE_METRICS)
        return CompileCounters(inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"],
                               inductor["fxgraph_cache_bypass"], aot["autograd_cache_hit"], aot["autograd_cache_miss"],
                               seconds, frames=len(compilation_time_metrics.get(_COMPILE_METRICS[0], [])))

    def since(self, before: "CompileCounters") -> "CompileCounters":
        return CompileCounters(*(getattr(self, f.name) - getattr(before, f.name) for f in dataclasses.fields(self)))

    @property
    def graphs(self) -> int:
        return self.fx_hits + self.fx_misses + self.fx_bypasses

    @property
    def from_cache(self) -> bool:
        """Every graph compiled since the snapshot came from the cache (and there was one)."""
        return self.graphs > 0 and self.fx_misses == 0 and self.fx_bypasses == 0 and self.autograd_misses == 0

    def summary(self) -> dict:
        """summary.json's fields."""
        return {"compile_s": round(self.compile_s, 2), "compile_fx_cache_hits": self.fx_hits,
                "compile_fx_cache_misses": self.fx_misses, "compile_fx_cache_bypasses": self.fx_bypasses,
                "compile_autograd_cache_hits": self.autograd_hits,
                "compile_autograd_cache_misses": self.autograd_misses, "compile_frames": self.frames}


def describe_compile(done: CompileCounters, cache: CompileCache) -> str:
    """The first step's line: where the compiled layers came from, and in how long."""
    bypassed = f", {done.fx_bypasses} not cacheable" if done.fx_bypasses else ""
    counts = (f"{done.frames} Dynamo frames, {done.fx_hits} of {done.graphs} graphs from inductor's cache{bypassed}, "
              f"AOTAutograd {done.autograd_hits} hits / {done.autograd_misses} misses")
    where = str(cache.directory) if cache.persistent else f"{_torch_default_dir()} (torch's default, emptied at reboot)"
    if done.from_cache:
        return f"compiled layers: from the cache in {done.compile_s:.1f} s ({counts}; {where})"
    return (f"compiled layers: compiled in {done.compile_s:.1f} s; cached in {where} for the next run "
            f"({counts}; {cache.source})")


# ---------------------------------------------------------------------------- what the cache holds
# compile_policy's auto asks before compiling whether the cache holds this run's layers: inductor
# can only tell by tracing them. A run that compiled writes a marker named by what changes the
# compiled code (below) once its first step is done; the next run with the same key finds it.
_MARKERS = "slidetune-layers"


def layer_compile_key(model_config, runtime, rows: int, seq_len: int, device_name: str) -> str:
    """A fingerprint of what the compiled layers depend on: torch's version, the model's layer
    config, the compute dtype, the layer settings (lean layer, tiles), the step's [rows, seq_len]
    (dynamic=False: a shape is a graph) and the device."""
    import torch
    arch = {k: v for k, v in model_config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    layer = {name: runtime.setting(name) for name in ("lean_layer", "lean_kernels", "mlp_tile_tokens",
                                                        "layer_row_tokens")}
    record = dict(torch=torch.__version__, arch=arch, dtype=str(runtime.torch_dtype), layer=layer, rows=rows,
                  seq_len=seq_len, device=device_name)
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _marker(cache: CompileCache, key: str) -> Path | None:
    return cache.directory / _MARKERS / f"{key}.json" if cache.persistent else None


def cache_holds(cache: CompileCache, key: str) -> bool:
    """Whether a run with this key compiled its layers into this cache before."""
    marker = _marker(cache, key)
    return marker is not None and marker.is_file()


def remember_compile(cache: CompileCache, key: str, done: CompileCounters) -> None:
    """After the first compiled step: the marker cache_holds reads (written atomically), with what
    the compile took. A cache directory that cannot be written costs the next run the compile, no more."""
    from ..atomic_write import write_atomically
    marker = _marker(cache, key)
    if marker is None:
        return
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"from_cache": done.from_cache, **done.summary()}) + "\n"
        write_atomically(marker, lambda tmp: tmp.write_text(text))
    except OSError as e:
        print(f"note: the compile cache {cache.directory} could not be written ({e}): the next run's "
              f"compile_layers auto will not count on it", file=sys.stderr)
