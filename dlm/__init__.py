"""dlm: a PyTorch toolkit for diffusion language models.

AR, masked diffusion (MDLM/LLaDA), uniform-state diffusion (DiffusionGemma), DFlash speculative
decoding and joint AR + diffusion, on one backbone, one data pipeline and one benchmark harness.
"""

__version__ = "0.1.0"
