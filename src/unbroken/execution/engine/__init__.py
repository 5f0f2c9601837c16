"""Engines: how a group of workers, one per rank, is placed, started, watched and killed.
The interface the controller drives is `base`; `factory` picks the engine for a
ScalingConfig; `local` (processes on this machine) and `ray` (actors on a Ray cluster)
implement it. Part of the execution layer: may import what `unbroken.execution` may.
"""
