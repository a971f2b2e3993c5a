"""The roof: the `tidal` command and what it runs around the roles (launching a run, sweeps, the batch
plan, preflight checks, the memory plan, placement). Nothing of a role imports it; it reaches the roles
through their public entry points."""
