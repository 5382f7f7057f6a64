"""Pretrained-model studies: where and how much packet loss hurts a real model (needs the real extra)."""
