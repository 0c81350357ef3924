# The `zeroshard` launcher: hostfile, backends (ssh, pdsh, openmpi, slurm), the per-node spawner and
# rank discovery under srun / mpirun. Standard library only, so `zeroshard ...` starts fast.
from .discovery import discover_env, expand_nodelist

__all__ = ["discover_env", "expand_nodelist"]
