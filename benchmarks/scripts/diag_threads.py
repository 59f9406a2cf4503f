"""Does CPU work issued from a worker thread get torch's full intra-op parallelism?

Times the fused CPU AdamW and the FP32->BF16 cast (into pinned memory) on the main
thread and on a threading.Thread, at the current torch thread count.
"""
import json
import threading
import time

import torch

from slidetune.engine.adamw import AdamWConfig, FlatAdamW

N = 64 * 2**20


def adam_rate():
    m = torch.randn(N)
    g = torch.randn(N)
    opt = FlatAdamW(m, N, AdamWConfig())
    opt.begin_step(); opt.update(g, 1e-5)
    t = time.perf_counter()
    for _ in range(3):
        opt.begin_step(); opt.update(g, 1e-5)
    return 3 * N / (time.perf_counter() - t)


def cast_rate():
    src = torch.randn(N)
    dst = torch.empty(N, dtype=torch.bfloat16, pin_memory=torch.cuda.is_available())
    dst.copy_(src)
    t = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    return 3 * N / (time.perf_counter() - t)


def in_thread(fn):
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("v", fn()))
    th.start(); th.join()
    return out["v"]


res = {"threads": torch.get_num_threads(),
       "adamw_main_params_s": adam_rate(), "adamw_thread_params_s": in_thread(adam_rate),
       "cast_main_elems_s": cast_rate(), "cast_thread_elems_s": in_thread(cast_rate)}
print(json.dumps(res, indent=1))
