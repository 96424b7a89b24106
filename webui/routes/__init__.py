"""The API's routers, one per concern; each reaches the shared state through `webui.context.Ctx`."""
