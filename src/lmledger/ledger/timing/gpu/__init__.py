"""The GPU op-time model (docs/time.md, "On a GPU you do not have"): a dry run's ops priced on a GPU from its
datasheet and its architecture's measured efficiencies, then replayed on the host's and the GPU's streams.
step.predict_gpu_step is the entry point; frameworks.py says which kernels a training framework runs."""

from lmledger.ledger.timing.gpu.frameworks import FRAMEWORKS, Kernels, kernels_for, lightning_kernels
from lmledger.ledger.timing.gpu.step import predict_gpu_step

__all__ = ["FRAMEWORKS", "Kernels", "kernels_for", "lightning_kernels", "predict_gpu_step"]
