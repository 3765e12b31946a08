"""specrl: RL post-training with speculative rollouts and an online co-trained EAGLE-3 draft.

Importing the package is cheap: no torch, no CUDA. Subpackages import torch when they need it.
"""

__version__ = "0.1.0"
