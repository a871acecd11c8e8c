"""Serving: OpenAI-compatible servers, their agent, registry and router."""
