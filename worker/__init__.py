"""The worker side of the round protocol (docs/protocol.md): ``app`` the process, ``loop``
one round read top-down, ``session`` every call to the coordinator (the seam ``faults``
injects at), ``stream`` the Rounds stream, ``trainer`` the inner AdamW loop."""
