"""The node's runtime pieces, composed by `exo.main.Node`: master election (`election`),
the local replica of the cluster state (`replica`), the event log it persists
(`event_log`, `event_log_upgrade`), the lock on the node's home directory (`home_lock`),
the gatherer of this machine's facts (`info_gatherer`), the start-up speed probe
(`speed_probe`, `speed_measurements`) and the link prober (`topology`).

Its floor is above the worker (the speed probe times the engine's own kernels) and below
the master, which persists through the event log (`docs/architecture.md`, "Floors").
"""
