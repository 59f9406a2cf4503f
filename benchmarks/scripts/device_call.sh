#!/usr/bin/env bash
# Run on the GPU machine (device tool) from the repo root: each argument is one job.
# Results go to $OUT/results.tar.gz (the device tool returns at most 8 files).
#   jobs: pipeline | train | equivalence | runtime | modes | recompute | head | roofline
set -u
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
R=/tmp/results; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/nvidia-smi.csv
for job in "$@"; do
  t0=$(date +%s)
  case $job in
    pipeline) python -m slidetune.cli bench pipeline --out $R/pipeline --steps 3 --warmup 2 ${PIPELINE_ARGS:-} ;;
    train) python -m slidetune.cli train --output-dir /tmp/train_gpu --progress false > $R/train_gpu.log 2>&1
           mkdir -p $R/train_default_gpu
           cp /tmp/train_gpu/{metrics.csv,loss.png,config.json,summary.json,run.json} $R/train_default_gpu/ 2>/dev/null
           tail -5 $R/train_gpu.log ;;
    equivalence) timeout 240 python -m pytest -q tests/test_equivalence_gpu.py > $R/gpu_equivalence_tests.txt 2>&1
           tail -3 $R/gpu_equivalence_tests.txt ;;
    runtime) python -m slidetune.cli bench runtime --out $R/runtime --parts ${RUNTIME_PARTS:-memory,big} ;;
    modes|recompute|head|roofline) python -m slidetune.cli bench $job --out $R/$job ${BENCH_ARGS:-} ;;
    *) echo "unknown job $job" ;;
  esac
  echo "[device_call] $job: rc=$? $(( $(date +%s) - t0 )) s"
  tar czf $OUT/results.tar.gz -C $R .      # after every job: a timeout still returns what finished
done
