"""Serving: OpenAI-compatible servers, their agent, registry and router.

Design notes: docs/serving.md (the builtin server: docs/model.md).
"""
