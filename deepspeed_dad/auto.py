"""``import deepspeed_dad.auto``: what the installed import hook does, by hand.

Importing it patches ``deepspeed.initialize`` (`deepspeed_dad.patch_deepspeed_initialize`), so
engines built from a DeepSpeed config with an enabled ``"dad"`` block (by the script, Accelerate or
the Hugging Face Trainer) synchronise their gradients with dAD instead of DeepSpeed's all-reduce.
The installed package's hook does this without the import; see `patch_deepspeed_initialize` for where
the line still serves.
"""
from .initialize import patch_deepspeed_initialize

patch_deepspeed_initialize()
