"""The app's tabs. Views talk to the engine only through ``app.bridge.Bridge`` signals."""
