"""The applications built on the library: ``mcf demo`` (:mod:`mcf.apps.demo`), the format commands
``mcf megatron``, ``mcf megacontext`` and ``mcf bucket`` (their ``*_cli`` modules; ``mcf`` itself is
:mod:`mcf.cli`) and the bucket's REST server (:mod:`mcf.apps.bucket_server`).  Nothing in the library
imports them.
"""
