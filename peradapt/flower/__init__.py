"""`--engine flower`: the same federation, with clients played by Flower ClientApps.

peradapt's round loop (`federation.engine`) stays the server's: it samples, runs the method's `server_update`
(PerAda's distillation included), evaluates, checkpoints and exports exactly as the builtin engine does. What
Flower adds is where the clients run and what travels: `strategy.PeradaptStrategy` turns each sampled client into
a message holding the global adapter, `client.app` (a ClientApp) plays that client with `clients.play_client` and
replies with its upload, and `server.FlowerClients` exchanges these messages through a Flower Grid.

- `peradapt train --engine flower` runs it in Flower's simulation runtime (Ray) on this machine (`simulation`).
- `flwr run` runs the same apps on a SuperLink and SuperNodes on other machines (`server.app`, docs/DEPLOY.md).

Importing this package needs Flower (`pip install 'peradapt[flower]'`).
"""

from peradapt.errors import ConfigError

try:
    import flwr  # noqa: F401
except ImportError:
    raise ConfigError("--engine flower needs Flower, which is not installed: pip install 'peradapt[flower]'") from None
