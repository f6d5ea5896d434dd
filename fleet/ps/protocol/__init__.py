"""The parameter server's wire: message format, authentication, size limits and errors."""
