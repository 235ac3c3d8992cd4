"""Trained draft heads: small networks that draft from the target's own hidden states.

    taps.py     record chosen target layers' outputs in the verifying forward (no fork of mlx-lm)
    eagle3.py   the EAGLE-3 head: format (config.json + safetensors, d2t/t2d) and forward pass,
                shared by loading and by training (`mlxspec train-drafter`)
"""
