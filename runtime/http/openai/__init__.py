"""OpenAI's wire format over Thaw's handlers: what the /v1 routes (runtime/http/routes/
openai.py) read and write.

    requests.py   an OpenAI request body -> the handler and the event it takes,
                  every parameter either honoured or refused (400), never ignored
    answers.py    the handler's output -> OpenAI's answer body; its items -> the
                  chunks of an SSE stream, then `data: [DONE]`

The work itself goes the one way every invocation goes (runtime/dispatch): an
embeddings request joins the handler's batches, a chat its decode steps. An
error's OpenAI body is runtime/http/problems.py's, as for every other answer.
"""
