"""accel_gpt: GPT-2 pretraining driven by Hugging Face Accelerate."""

__version__ = "0.1.0"
