"""The server's plumbing: what carries a request between a socket and the request pipeline.

The ASGI app and its routes (``app``), a gunicorn front-end process (``frontend``,
``gunicorn_worker``), the listeners of the three planes and their TLS (``listeners``,
``http_conn``), the stop order and the drain (``service_state``, ``drain``), admission and its
queue (``admission``), Prometheus metrics (``metrics``), the request log (``request_log``) and
the one ready line a launch prints (``ready_line``). What a request *says* (its parsing, its text,
its tools and grammar) is ``mindie.text`` and ``mindie.api``; none of it lives here.
"""
