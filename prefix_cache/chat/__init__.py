"""The APIs' bodies and answers, neutral of any server and of any engine.

Parsers, body -> a neutral call (``agent_call.py``: ``AgentCall``): ``openai_params.py``,
``anthropic_params.py``, ``responses_params.py``, over the checked fields every API reads
(``fields.py``), the fields that bind the output (``output_fields.py``) and those that change the
render (``render_fields.py``), all converted to the chat-template conversation
(``conversation.py``). A turn's neutral ``events.py`` -- from an engine, or from an upstream's chat
completion (``openai_decode.py``) -- written in each API's shape by ``openai_encode.py``,
``anthropic_encode.py``, ``responses_encode.py``, as JSON or SSE (``respond.py``). Beside them:
stored responses (``responses_store.py``), a body's API detected (``bodies.py``) and the
hosted tools a target cannot run (``hosted_tools.py``). Importing
this package imports no engine.
"""
