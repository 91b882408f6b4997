"""Text handling in the front end: what a request says and what an answer says back.

Chat templates (``chat_template``), the incremental detokenizer (``detokenizer``), a generation's
pieces, stop strings and deadlines (``generation``), request validation and the fields accepted
but ignored (``validation``, ``ignored_fields``), structured output's grammars and checks
(``structured``), tool calls and their per-model parsers (``tool_calls``, ``tool_parsers/``) and
reasoning sections (``reasoning``). No sockets, no processes: the server's plumbing is
``mindie.server``.
"""
