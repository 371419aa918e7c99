"""Emulated WAN links: the unprivileged asyncio relay (``emulator``) and ``tc`` shaping in
containers (``tc``), both driven by ``geoloco.profiles.LinkProfile``."""
