"""The one JSON scanner the Envoy Lua filters share (Envoy's Lua has no JSON library).

`top_level_value(s, key)` finds top-level `key` of the JSON object `s` without parsing it:
strings and nested values are skipped, so the same key inside a message, a prompt or a
grammar doesn't count. lua.py reads TGI's `stream` with it, affinity.py OpenAI's
`prompt_cache_key`.
"""

TOP_LEVEL_VALUE = r"""
-- The value of top-level `key` in the JSON object `s`: a string's raw text (escapes kept)
-- and true, or a literal (true, false, null, a number) and false; nil if absent or nested.
local function top_level_value(s, key)
  local i, depth, last, after_colon = 1, 0, nil, false
  while true do
    i = s:find('["{}%[%]:]', i)
    if i == nil then return nil end
    local c = s:sub(i, i)
    if c == '"' then
      local j = i + 1
      while true do
        j = s:find('["\\]', j)
        if j == nil then return nil end
        if s:sub(j, j) == '"' then break end
        j = j + 2  -- skip the escaped character
      end
      local text = s:sub(i + 1, j - 1)
      if after_colon then
        if depth == 1 and last == key then return text, true end
        last, after_colon = nil, false
      else
        last = text
      end
      i = j + 1
    elseif c == ':' then
      local literal = s:match('^%s*([%w%.%-%+]+)', i + 1)
      if literal ~= nil then
        if depth == 1 and last == key then return literal, false end
        -- the value was a literal: the next string is a key again
        last, after_colon = nil, false
      else
        after_colon = true
      end
      i = i + 1
    else
      if c == '{' or c == '[' then depth = depth + 1 else depth = depth - 1 end
      last, after_colon = nil, false
      i = i + 1
    end
  end
end
"""
