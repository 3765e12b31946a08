"""The shared heart of specrl: attention (packed, branch, ring) and transport (TapChannel).

Knows nothing of RL or of the CLI.
"""
