"""`python -m jaxfeed.service.dispatcher [FLAGS]`: runs a dispatcher."""

from absl import app
from absl import flags

from jaxfeed.service.dispatcher import server

if __name__ == "__main__":
  # absl's --help shows the main module's docstring and flags: the server's.
  __doc__ = server.__doc__
  server.define_flags()
  flags.adopt_module_key_flags(server)
  app.run(server.main)
