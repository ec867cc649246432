"""One-line opt-in for Accelerate and the Hugging Face Trainer: ``import deepspeed_dad.auto``.

Importing it patches ``deepspeed.initialize`` (`deepspeed_dad.patch_deepspeed_initialize`), so
engines that these libraries build from a DeepSpeed config with an enabled ``"dad"`` block
synchronise their gradients with dAD instead of DeepSpeed's all-reduce.
"""
from .initialize import patch_deepspeed_initialize

patch_deepspeed_initialize()
