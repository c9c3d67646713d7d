"""A path parameter that may hold any text: `/` and control characters included.

A model id such as `org/model` reaches the server as one escaped segment (`org%2Fmodel`, as the
`openai` SDK sends it), which the server decodes before routing: Starlette's `path` convertor
(`.*`) takes the `/` but not a newline, so `/v1/models/a%0Ab` would match no route and get a bare
404 before authentication. `{name:any}` matches whatever the segment decodes to.
"""

from starlette.convertors import Convertor, register_url_convertor

ANY = "any"


class AnyText(Convertor[str]):
    regex = "[\\s\\S]+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor(ANY, AnyText())
