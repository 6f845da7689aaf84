"""Runner strategies, one forward of the model per step: eager (model_runner.py), replayed
from CUDA graphs (cuda_graphs.py), torch.compile'd (compiled.py), over shards (sharded.py)."""
