"""The top layer: the `rlhf` command and the local services it starts (`rlhf up` / `down`). Nothing below imports it."""
