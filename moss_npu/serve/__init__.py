"""An OpenAI-compatible speech server: ``python -m moss_npu.serve --model DIR --codec DIR --device cpu``.

``app`` holds the HTTP API (and the page), ``edge`` what is decided from the headers before a body is read,
``connections`` uvicorn's connection limits, ``pool`` the worker processes (one per device), ``spec`` and
``worker`` what runs inside one, ``schema`` the request body, ``formats`` audio out, ``voices`` the voice store,
``live`` the WebSocket session, ``drain`` the stop and ``metrics`` the Prometheus metrics. Needs the ``serve``
extra (``pip install -e ".[serve]"``).
"""
