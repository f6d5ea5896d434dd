"""The table shards a parameter server holds: the bookkeeping every shard shares (base), and a dense and a
sparse kind. :mod:`fleet.ps.server.aggregator` names them for the rest of the server."""
