"""Operations tools: the command-line programs an operator, a probe or the launch script runs
beside the server (never imported by the request path).

- ``prepare.py``: the launch step: config.json -> the launch plan (``deployment.json``), the run
  directory, the listeners (scripts/launch.sh runs it first)
- ``probe.py``: health checks and the pre-stop drain (scripts/health_check.sh, prestop.sh;
  console script ``mindie-probe``)
- ``curve_keys.py``: CURVE key generation for tcp worker links (``mindie-curve-keys``)
- ``tls_check.py``: checks a launch plan's TLS files (the launcher runs it before a reload)
- ``run_dir.py``: claims, holds, releases the run directory; asks a running server to stop
"""
