"""Simulator studies: the real router and autoscaler policy against `sim/`'s model of vLLM
engines, at replica counts this machine cannot run for real. Deterministic for a given seed."""
