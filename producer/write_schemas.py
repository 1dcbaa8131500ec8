"""``python -m producer.write_schemas [FOLDER]``: the protocol's JSON Schemas (job payload, event, result) from the
models, into ``docs/schemas/`` by default. (``python -m producer.wire`` does the same with a RuntimeWarning: the
package imports that module before runpy runs it.)"""

from producer.wire import main

if __name__ == "__main__":
    main()
