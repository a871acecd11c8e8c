"""The fleet's one OpenAI endpoint: tpupod's router (``server``: policies, retries,
streaming; ``upstream``, its client; ``registry``, the backends' health) or
sgl-router in its place (``sgl``).
"""
