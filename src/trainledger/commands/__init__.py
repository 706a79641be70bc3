"""One module per subcommand: ``add_parser`` declares its flags, ``run`` calls the library and prints."""
