"""The neutral room: what api/ and workers/ both need (settings, task and queue names, channel names,
message builders). It imports neither of them; both import it."""
