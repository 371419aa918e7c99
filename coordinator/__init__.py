"""The coordinator side of the round protocol (docs/protocol.md): ``app`` the process,
``loop`` one round as named steps, ``service`` the gRPC servicer, ``state`` what the two
share, ``rounds`` the pure round state and close policy."""
