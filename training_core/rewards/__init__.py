"""Reward functions: built-ins, user functions by import path, and where they run."""
