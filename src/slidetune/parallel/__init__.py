"""Data parallel across processes: `train --gpus N` relaunching itself under torchrun (launch.py) and
the trainer's view of its ranks (ranks.py). The engine's gradient reduction is engine/distributed.py."""
