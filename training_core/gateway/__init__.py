"""Agentic RL: an OpenAI- and Anthropic-compatible gateway in front of the rollout servers.

Agents written against those APIs train by pointing ``base_url`` at the gateway (server.py:
sessions, listeners, routing; http.py: the bounded HTTP server). Every API (chat_api.py,
responses_api.py, anthropic_api.py) reads its request into plain chat messages (requests.py)
and runs one turn (turn.py): the ids of a conversation kept exactly as sampled across turns
(chat.py, session.py), the run's sampling policy (sampling.py), tool calls and reasoning parsed
per model family (tools.py); credit is assigned per segment (credit.py). Online mode
(workflows/online.py) serves agents that run elsewhere.
"""
