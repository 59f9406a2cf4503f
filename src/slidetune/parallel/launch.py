"""`slidetune train --gpus N`: the same command on N data-parallel ranks (docs/data_parallel.md).

The process re-executes itself through torch.distributed.run (torchrun), one host, N processes
(or, where torchrun lacks --shutdown-timeout, starts it as a child and supervises it: relaunch):

    python -m torch.distributed.run --standalone --nproc-per-node N -m -- slidetune.cli train <args without --gpus>

`torchrun --nproc-per-node N -m -- slidetune.cli train ...` is the same run started by hand (and the
way to span hosts). The `--` ends torchrun's own options: without it torchrun's parser takes any of
the run's flags that abbreviate one of its own (`--master bf16`: `--master-addr`?) and refuses it.
Each rank takes the GPU of its LOCAL_RANK (ranks.Ranks.start); `--device cpu` starts N CPU
processes over gloo instead (for tests: the same code paths without GPUs).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import NoReturn

FLAG = "--gpus"
# On a signal torchrun forwards it to the ranks and kills them this many seconds later: the ranks
# finish their step and rank 0 writes a resumable checkpoint first, which for a large model takes
# minutes (torchrun's own default is 30 s).
SHUTDOWN_TIMEOUT_S = 900


def without_gpus_flag(argv: list[str]) -> list[str]:
    """argv less `--gpus N` / `--gpus=N` (what each rank is started with)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == FLAG:
            skip = True
        elif not a.startswith(FLAG + "="):
            out.append(a)
    return out


def visible_gpus() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_gpus(n: int, device: str, visible: int) -> None:
    """Refuse a --gpus N that cannot run here, naming the fix."""
    if n < 1:
        raise ValueError(f"{FLAG} {n}: the number of ranks must be at least 1")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(f"{FLAG} starts the ranks itself, but this process is already one of "
                         f"{os.environ['WORLD_SIZE']} ranks (torchrun): leave {FLAG} out under torchrun")
    if device == "cpu":
        return                     # N CPU processes over gloo
    if n > visible:
        where = f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}" \
            if "CUDA_VISIBLE_DEVICES" in os.environ else "no CUDA_VISIBLE_DEVICES set"
        fix = (f"use {FLAG} {visible} or fewer" if visible else
               f"run on a machine with GPUs, or add --device cpu to start {n} CPU processes (gloo; for testing)")
        raise ValueError(f"{FLAG} {n} with --device {device}: this machine has {visible} visible GPU"
                         f"{'' if visible == 1 else 's'} ({where}); {fix}")


def torchrun_has_shutdown_timeout() -> bool:
    """Whether this torch's torchrun takes --shutdown-timeout (torch 2.13 does; 2.11, the GPU
    machine's, rejects it and its ranks get torchrun's fixed 30 s after a forwarded signal)."""
    from torch.distributed.run import get_args_parser
    return any("--shutdown-timeout" in a.option_strings for a in get_args_parser()._actions)


def torchrun_prefix(n: int) -> list[str]:
    """torchrun on n ranks of this host, up to the module it runs (`-m MODULE ARGS...` follows)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]
    if torchrun_has_shutdown_timeout():
        cmd += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    return cmd


def torchrun_command(n: int, argv: list[str]) -> list[str]:
    """The command that runs `slidetune <argv>` (argv without --gpus) on n ranks of this host ("--":
    the rest is the module and its arguments, never torchrun's options)."""
    return [*torchrun_prefix(n), "-m", "--", "slidetune.cli", *argv]


def host_cores() -> int:
    """The cores this process may run on (its affinity, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def rank_threads_env(n: int, env: dict | None = None) -> dict:
    """The environment for n ranks of one host: OMP_NUM_THREADS = the host's cores / n, unless set.
    torchrun sets it to 1 when it starts several ranks and it is unset, and torch's thread pool
    (the host AdamW's threads: RuntimeConfig.resolved_host_threads) follows it: each rank would
    run its shard's AdamW on one core of a 16-core host. The ranks share the host's cores."""
    env = dict(os.environ if env is None else env)
    if n > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, host_cores() // n))
    return env


# Test hook (not a user flag): supervise the ranks even where torchrun has --shutdown-timeout, so
# the CPU tests (torch 2.13) run the path the GPU machine's torch 2.11 takes.
SUPERVISE_ENV = "SLIDETUNE_SUPERVISE_RANKS"


def relaunch(n: int, argv: list[str]) -> NoReturn:
    """Run `slidetune <argv>` on n ranks through torchrun (never returns).

    Where this torch's torchrun takes --shutdown-timeout, this process becomes torchrun (exec): a
    signal to the command reaches torchrun, which forwards it to every rank and waits that long for
    the stop checkpoint. Older torchrun (2.11) kills the ranks 30 s after forwarding a signal, too
    soon for a large model's checkpoint, so there this process stays and supervises (supervise)."""
    cmd = torchrun_command(n, without_gpus_flag(argv))
    print(f"slidetune: starting {n} ranks: {' '.join(cmd)}", flush=True)
    sys.stderr.flush()
    env = rank_threads_env(n)
    if torchrun_has_shutdown_timeout() and not os.environ.get(SUPERVISE_ENV):
        os.execve(sys.executable, cmd, env)
    sys.exit(supervise(cmd, env))


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the parent dies (a kill -9 of the command
    then still stops torchrun, which forwards it to the ranks)."""
    try:
        import ctypes
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def supervise(cmd: list[str], env: dict) -> int:
    """torchrun as a child in a session of its own, so a terminal's Ctrl-C reaches this process
    only; SIGINT/SIGTERM here go straight to the ranks (torchrun's children, each in its own
    session), never to torchrun, whose forwarded signal would start its 30 s kill timer. The ranks
    stop after the same step, rank 0 writes the checkpoint while the others wait for it, and all
    exit; torchrun then ends. A third signal kills torchrun and the ranks at once.
    Returns torchrun's exit status, or 130 once a signal was forwarded (an interrupted run's)."""
    import psutil

    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        ranks = psutil.Process(proc.pid).children()
        if not ranks:                 # torchrun has not started them yet: nothing to checkpoint
            proc.send_signal(signum)
        for rank in ranks:
            try:
                rank.send_signal(signal.SIGKILL if len(received) >= 3 else signum)
            except psutil.NoSuchProcess:
                pass
        if len(received) >= 3:
            proc.kill()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    status = proc.wait()
    return 130 if received else status
