"""Reinforcement learning with verifiable rewards: reward functions and RL prompt data."""
